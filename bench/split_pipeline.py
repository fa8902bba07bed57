"""A split instance against a whole one: a decoder-only transformer (random weights from a seed) served
(a) WHOLE in one action runtime process and (b) SPLIT into ``--stages`` runtime processes, each started with
the stage variables the invoker gives a split instance's stages (``DILU_STAGE_INDEX``, ``DILU_STAGE_COUNT``,
``DILU_STAGE_SPAN``) and each building only its own layers (``dilu_invoker.actions.pipeline``). Both are
driven through HTTP ``/init`` and ``/run`` with the invoker's own client (``RuntimeClient``, the bodies of
``build_init_body``/``build_run_body``); a split request runs stage 0 on the activation's params and feeds
each stage's result to the next stage's ``/run``, as the invoker does.

    PYTHONPATH=. python3 bench/split_pipeline.py --device cuda [--layers 24 --d-model 2048 --heads 16
        --seq 512 --batch 4 --stages 2 --requests 50 --warmup 5] --out docs/benchmarks/split-pipeline.md --json FILE
    PYTHONPATH=. python3 bench/split_pipeline.py --device cpu --layers 4 --d-model 64 ...   # a dry run

Measured: the largest absolute difference of the split result (the last position's logits) from the whole
one, request for request; each request's latency, whole and split (requests alternate between the two, so
the machine's noise hits both alike), p50/p90/max and the split/whole ratio; what each process holds (its
weights, and torch.cuda.max_memory_allocated since the weights were built, as its result reports it: each
stage should hold about its share) and the intermediate result's size (the JSON body between stages).

The model is built with torch.nn (``nn.TransformerEncoderLayer``, pre-norm, GELU, 4×d feed-forward, causal
mask: a decoder-only block) in ``--dtype`` (fp16 on CUDA, fp32 on the CPU by default); stage 0 holds the token
embedding, the last stage the final norm and the LM head. Without torch (``--backend numpy``, or ``auto``
where torch is not installed) the same model is written in numpy (float32, one attention head per block):
the same API and measurements, for a dry run on a machine without torch.

On a machine with one GPU every process runs on GPU 0 (the output says so); on an invoker each stage has its
own GPU, which ``--spread-gpus`` imitates where there are enough of them (stage k sees only GPU k).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dilu_invoker.actions import pipeline

try:  # the invoker's own client; it needs the invoker's dependencies (structlog), not only the runtime's
    import structlog

    from dilu_invoker.invoker.dataplane.runtime_client import (
        ActivationContext,
        RuntimeClient,
        build_init_body,
        build_run_body,
    )

    # Its debug line per /run would drown the report.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
except ImportError:  # pragma: no cover - a machine with only the runtime's dependencies
    RuntimeClient = None  # type: ignore[assignment,misc]

CONFIG_ENV = "SPLIT_BENCH_CONFIG"
#: intermediate results may be up to 64 MiB of JSON (docs/runtime.md, "Pipeline stages"); the client's default is 1 MiB
MAX_RESULT_BYTES = 80 * 1024 * 1024

# -- the action (one text for the whole process and every stage) ----------------------------------------

TORCH_ACTION = r'''
import json, os, resource, time
import torch
from torch import nn
from dilu_invoker.actions import pipeline

CFG = json.loads(os.environ["SPLIT_BENCH_CONFIG"])
ME = pipeline.stage()
MINE = ME.layers(CFG["layers"])
DEVICE = torch.device(CFG["device"])
DTYPE = getattr(torch, CFG["dtype"])
D = CFG["d_model"]


def fill(module, part):
    """Weights from (seed, part) alone, so a stage builds only its own parts, and builds them as the whole does."""
    g = torch.Generator(device=DEVICE)
    g.manual_seed(CFG["seed"] * 1_000_003 + part)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() >= 2:
                # In place: no float32 temporaries (they would be the process's peak, not its serving)
                p.normal_(0.0, 1.0 if isinstance(module, nn.Embedding) else p.shape[-1] ** -0.5, generator=g)
            elif name.endswith("weight"):
                p.fill_(1.0)  # norms
            else:
                p.zero_()  # biases
    return module.eval()


def block():
    return nn.utils.skip_init(nn.TransformerEncoderLayer, D, CFG["heads"], 4 * D, dropout=0.0, activation="gelu",
                              batch_first=True, norm_first=True, device=DEVICE, dtype=DTYPE)


EMBED = fill(nn.utils.skip_init(nn.Embedding, CFG["vocab"], D, device=DEVICE, dtype=DTYPE), CFG["layers"]) if ME.first else None
BLOCKS = [fill(block(), i) for i in MINE]
if ME.last:
    NORM = fill(nn.utils.skip_init(nn.LayerNorm, D, device=DEVICE, dtype=DTYPE), CFG["layers"] + 1)
    HEAD = fill(nn.utils.skip_init(nn.Linear, D, CFG["vocab"], bias=False, device=DEVICE, dtype=DTYPE), CFG["layers"] + 2)
else:
    NORM = HEAD = None
WEIGHTS = sum(p.numel() * p.element_size() for m in [EMBED, *BLOCKS, NORM, HEAD] if m is not None for p in m.parameters())
CUDA = DEVICE.type == "cuda"
if CUDA:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the peak reported is serving's: the weights and the requests' activations


def main(args):
    start = time.perf_counter()
    with torch.inference_mode():
        if ME.first:
            x = EMBED(torch.tensor(args["tokens"], device=DEVICE))
            meta = {"request": args["request"], "stats": []}
        else:
            x, meta = pipeline.receive(args, device=str(DEVICE))
        received = time.perf_counter()
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=DEVICE, dtype=DTYPE)
        for layer in BLOCKS:
            x = layer(x, src_mask=mask, is_causal=True)
        if ME.last:
            logits = HEAD(NORM(x[:, -1])).float()
            meta["next_tokens"] = logits.argmax(-1).tolist()
            x = logits
        if CUDA:
            torch.cuda.synchronize()
        computed = time.perf_counter()
        stats = {
            "stage": ME.index, "count": ME.count, "span": list(ME.span), "layers": [MINE.start, MINE.stop],
            "weights_bytes": WEIGHTS, "receive_ms": (received - start) * 1e3, "compute_ms": (computed - received) * 1e3,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if CUDA else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device": torch.cuda.get_device_name() if CUDA else "cpu",
            "cuda_device": torch.cuda.current_device() if CUDA else None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "backend": "torch " + torch.__version__,
        }
        result = pipeline.send(x, **meta)
        stats["send_ms"] = (time.perf_counter() - computed) * 1e3
        result["stats"] = [*meta["stats"], stats]
        return result
'''

NUMPY_ACTION = r'''
import json, os, resource, time
import numpy as np
from dilu_invoker.actions import pipeline

CFG = json.loads(os.environ["SPLIT_BENCH_CONFIG"])
ME = pipeline.stage()
MINE = ME.layers(CFG["layers"])
D = CFG["d_model"]


def weights(part, *shapes):
    rng = np.random.default_rng([CFG["seed"], part])
    # blocks: 1/sqrt(fan-in); the embedding 1 (the head is scaled where it is made)
    return [(rng.standard_normal(s) * (s[0] ** -0.5 if part < CFG["layers"] else 1.0)).astype(np.float32)
            for s in shapes]


def norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def block(w, x):
    """A pre-norm decoder block with one causal attention head."""
    wq, wk, wv, wo, w1, w2 = w
    h = norm(x)
    q, k, v = h @ wq, h @ wk, h @ wv
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)
    scores = scores + np.triu(np.full(scores.shape[-2:], -np.inf, dtype=np.float32), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    x = x + (p / p.sum(-1, keepdims=True)) @ v @ wo
    return x + gelu(norm(x) @ w1) @ w2


EMBED = weights(CFG["layers"], (CFG["vocab"], D))[0] if ME.first else None
BLOCKS = [weights(i, (D, D), (D, D), (D, D), (D, D), (D, 4 * D), (4 * D, D)) for i in MINE]
HEAD = weights(CFG["layers"] + 2, (D, CFG["vocab"]))[0] / np.float32(np.sqrt(D)) if ME.last else None
WEIGHTS = sum(a.nbytes for a in [EMBED, HEAD, *[w for b in BLOCKS for w in b]] if a is not None)


def main(args):
    start = time.perf_counter()
    if ME.first:
        x = EMBED[np.asarray(args["tokens"])]
        meta = {"request": args["request"], "stats": []}
    else:
        x, meta = pipeline.receive(args, as_numpy=True)
    received = time.perf_counter()
    for w in BLOCKS:
        x = block(w, x)
    if ME.last:
        x = norm(x[:, -1]) @ HEAD
        meta["next_tokens"] = x.argmax(-1).tolist()
    computed = time.perf_counter()
    stats = {
        "stage": ME.index, "count": ME.count, "span": list(ME.span), "layers": [MINE.start, MINE.stop],
        "weights_bytes": int(WEIGHTS), "receive_ms": (received - start) * 1e3, "compute_ms": (computed - received) * 1e3,
        "peak_gpu_bytes": None, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": "cpu", "cuda_device": None, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "backend": "numpy " + np.__version__,
    }
    result = pipeline.send(np.ascontiguousarray(x, dtype=np.float32), **meta)
    stats["send_ms"] = (time.perf_counter() - computed) * 1e3
    result["stats"] = [*meta["stats"], stats]
    return result
'''


# -- the runtimes ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class Runtime:
    """One action runtime process (`python -m dilu_invoker.actions.runtime`), its logs in `scratch`."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    scratch: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "".join(f"--- {self.name} {part} ---\n" + (self.scratch / f"{part}.log").read_text(errors="replace")[-4000:]
                       for part in ("stdout", "stderr"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_runtime(name: str, scratch: Path, extra_env: dict[str, str]) -> Runtime:
    port = free_port()
    scratch.mkdir(parents=True)
    (scratch / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch / "tmp"), **extra_env}
    env.pop("__OW_ALLOW_CONCURRENT", None)
    with open(scratch / "stdout.log", "wb") as out, open(scratch / "stderr.log", "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "dilu_invoker.actions.runtime", "--port", str(port), "--deadline-grace-ms", "-1"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )
    return Runtime(name, process, port, scratch)


class PlainClient:
    """The invoker's /init and /run bodies over plain aiohttp, where the invoker's client cannot be imported."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session, self._url = session, base_url

    async def call(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[bool, Any, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self._session.post(self._url + path, data=json.dumps(body, separators=(",", ":")),
                                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                    raw = await response.read()
                    result = json.loads(raw) if raw else None
                    ok = response.status == 200 and not (isinstance(result, dict) and "error" in result)
                    return ok, result, len(raw)
            except aiohttp.ClientConnectorError:
                if path != "/init" or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


class Driver:
    """/init and /run on one runtime as the invoker makes them."""

    def __init__(self, session: aiohttp.ClientSession, runtime: Runtime, *, plain: bool, frames: bool = False) -> None:
        self.runtime = runtime
        self._session = session
        self._plain = PlainClient(session, runtime.url) if plain or RuntimeClient is None else None
        self._client = None if self._plain else RuntimeClient(session, runtime.url, max_result_bytes=MAX_RESULT_BYTES)
        #: hand tensors on as stage frames where the runtime says at /init that it takes them (as the invoker does)
        self._frames = frames and self._client is not None
        self.stage_frames = False

    @staticmethod
    def _context(timeout_s: float) -> Any:
        if RuntimeClient is None:
            return None
        return ActivationContext(namespace="guest", action_name="/guest/split-llm", action_version="0.0.1",
                                 activation_id=uuid.uuid4().hex, transaction_id=uuid.uuid4().hex,
                                 deadline_ms=int((time.time() + timeout_s) * 1000))

    def _bodies(self, timeout_s: float) -> tuple[Any, Any]:
        context = self._context(timeout_s)
        if context is None:
            def init(code: str, env: dict[str, str]) -> dict[str, Any]:
                return {"value": {"name": "split-llm", "main": "main", "binary": False, "code": code, "env": env}}

            def run(value: Any) -> dict[str, Any]:
                return {"value": value, "namespace": "guest", "action_name": "/guest/split-llm", "action_version": "0.0.1",
                        "activation_id": uuid.uuid4().hex, "transaction_id": uuid.uuid4().hex,
                        "deadline": str(int((time.time() + timeout_s) * 1000))}
            return init, run
        return (lambda code, env: build_init_body(name="split-llm", code=code, binary=False, env=env, context=context),
                lambda value: build_run_body(value, context))

    async def init(self, code: str, env: dict[str, str], timeout_s: float) -> None:
        body = self._bodies(timeout_s)[0](code, env)
        if self._plain is not None:
            ok, result, _ = await self._plain.call("/init", body, timeout_s)
        else:
            assert self._client is not None
            outcome = await self._client.init(body, timeout_s)
            ok, result = outcome.ok, outcome.result
            if ok and outcome.stage_frames and self._frames:
                self.stage_frames = True
                self._client = RuntimeClient(self._session, self.runtime.url, max_result_bytes=MAX_RESULT_BYTES,
                                             stage_frames=True)
        if not ok:
            raise RuntimeError(f"/init of {self.runtime.name} failed: {result}\n{self.runtime.logs()}")

    async def run(self, value: Any, timeout_s: float, stage: bool | None = None) -> tuple[Any, int, float]:
        """The result, its size (bytes of JSON, or of the stage frame) and the round trip's seconds; `stage` as
        `RuntimeClient.run` takes it (a stage's run, which goes as a stage frame where the runtime takes them)."""
        body = self._bodies(timeout_s)[1](value)
        start = time.perf_counter()
        if self._plain is not None:
            ok, result, size = await self._plain.call("/run", body, timeout_s)
        else:
            assert self._client is not None
            outcome = await self._client.run(body, timeout_s, stage=stage if self.stage_frames else None)
            ok, result, size = outcome.ok, outcome.result, outcome.size or 0
        elapsed = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"/run of {self.runtime.name} failed: {str(result)[:2000]}\n{self.runtime.logs()}")
        return result, size, elapsed


# -- measuring ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(latencies_ms: list[float]) -> dict[str, float]:
    return {"p50": percentile(latencies_ms, 0.5), "p90": percentile(latencies_ms, 0.9), "max": max(latencies_ms)}


def spans(count: int) -> list[tuple[float, float]]:
    """Even shares by memory, as the invoker writes for stages of equal memory (wire.stage_span)."""
    return [(k / count, 1.0 if k == count - 1 else (k + 1) / count) for k in range(count)]


def logits_of(result: dict[str, Any]) -> Any:
    array, _ = pipeline.receive(result, as_numpy=True)
    return array


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    backend = args.backend
    if backend == "auto":
        backend = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    if backend == "numpy" and args.device != "cpu":
        raise SystemExit("the numpy model runs on the CPU only (--device cpu)")
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    config = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "vocab": args.vocab, "seed": args.seed,
              "device": args.device, "dtype": dtype if backend == "torch" else "float32"}
    code = TORCH_ACTION if backend == "torch" else NUMPY_ACTION
    base_env = {CONFIG_ENV: json.dumps(config)}
    stage_spans = spans(args.stages)
    scratch = Path(tempfile.mkdtemp(prefix="dilu-split-bench-"))
    runtimes: list[Runtime] = []
    try:
        # Several BLAS thread pools that spin on a few shared cores measure the spinning, not the model.
        threads = args.cpu_threads if args.cpu_threads is not None else (1 if args.device == "cpu" else None)
        pools = {} if threads is None else {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        visible = {"CUDA_VISIBLE_DEVICES": "0"} if args.spread_gpus else {}
        runtimes.append(start_runtime("whole", scratch / "whole", {**pools, **visible}))
        for k in range(args.stages):
            gpu = {"CUDA_VISIBLE_DEVICES": str(k)} if args.spread_gpus else {}
            runtimes.append(start_runtime(f"stage{k}", scratch / f"stage{k}", {**pools, **gpu}))
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            drivers = [Driver(session, rt, plain=args.plain_client, frames=args.hops == "frames") for rt in runtimes]
            whole, stages = drivers[0], drivers[1:]
            envs = [base_env] + [{**base_env, pipeline.ENV_INDEX: str(k), pipeline.ENV_COUNT: str(args.stages),
                                  pipeline.ENV_SPAN: f"{a!r}:{b!r}"} for k, (a, b) in enumerate(stage_spans)]
            started = time.perf_counter()
            await asyncio.gather(*(d.init(code, env, args.timeout) for d, env in zip(drivers, envs, strict=True)))
            init_s = time.perf_counter() - started

            async def run_whole(params: dict[str, Any]) -> tuple[dict[str, Any], float]:
                result, _, elapsed = await whole.run(params, args.timeout)
                return result, elapsed

            hops: list[dict[str, float]] = []

            async def run_split(params: dict[str, Any]) -> tuple[dict[str, Any], float]:
                value: Any = params
                total = 0.0
                for k, driver in enumerate(stages):
                    value, size, elapsed = await driver.run(value, args.timeout, stage=k < len(stages) - 1)
                    total += elapsed
                    if k < len(stages) - 1:
                        wire = value[pipeline.FIELD]
                        hops.append({"stage": k, "json_bytes": size,
                                     "tensor_bytes": math.prod(wire["shape"]) * pipeline.DTYPES[wire["dtype"]][0]})
                return value, total

            rng = np.random.default_rng(args.seed)

            def request(i: int) -> dict[str, Any]:
                return {"request": i, "tokens": rng.integers(0, args.vocab, (args.batch, args.seq)).tolist()}

            for i in range(args.warmup):
                params = request(-1 - i)
                await run_whole(params)
                await run_split(params)
            hops.clear()
            lat: dict[str, list[float]] = {"whole": [], "split": []}
            #: per request, the part of its latency spent outside the actions' main (HTTP, the runtimes, JSON)
            outside: dict[str, list[float]] = {"whole": [], "split": []}
            diffs: list[float] = []
            same_tokens = True
            last: dict[str, dict[str, Any]] = {}
            for i in range(args.requests):
                params = request(i)
                # Alternate which goes first, so a slow moment of the machine lands on both alike.
                order = ("whole", "split") if i % 2 == 0 else ("split", "whole")
                results: dict[str, dict[str, Any]] = {}
                for mode in order:
                    result, elapsed = await (run_whole if mode == "whole" else run_split)(params)
                    results[mode] = result
                    lat[mode].append(elapsed * 1e3)
                    in_main = sum(s["receive_ms"] + s["compute_ms"] + s["send_ms"] for s in result["stats"])
                    outside[mode].append(elapsed * 1e3 - in_main)
                diff = np.abs(logits_of(results["split"]).astype(np.float64) - logits_of(results["whole"]).astype(np.float64))
                diffs.append(float(diff.max()) if diff.size else 0.0)
                same_tokens &= results["split"]["next_tokens"] == results["whole"]["next_tokens"]
                last = results
    finally:
        for rt in runtimes:
            rt.stop()
        if args.keep_logs:
            print(f"runtime logs kept under {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    whole_stats = last["whole"]["stats"][0]
    stage_stats = last["split"]["stats"]
    whole_summary, split_summary = summary(lat["whole"]), summary(lat["split"])
    gpu_note = None
    if args.device == "cuda":
        if args.spread_gpus:
            gpu_note = "stage k on GPU k (CUDA_VISIBLE_DEVICES=k), the whole process on GPU 0"
        else:
            gpu_note = (f"one GPU: the whole process and all {args.stages} stages run on GPU 0 (each its own process and "
                        f"CUDA context); on an invoker each stage has its own GPU")
    return {
        "utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": "PYTHONPATH=. python3 " + shlex.join(["bench/split_pipeline.py", *sys.argv[1:]]),
        "machine": machine_line(whole_stats.get("device", "cpu")),
        "backend": whole_stats["backend"],
        "client": "plain aiohttp" if args.plain_client or RuntimeClient is None else "RuntimeClient",
        "hops_as": "stage frames" if all(d.stage_frames for d in stages) else "JSON",
        "gpu_note": gpu_note,
        "config": {**config, "stages": args.stages, "seq": args.seq, "batch": args.batch, "requests": args.requests,
                   "warmup": args.warmup, "cpu_threads": threads},
        "init_s": init_s,
        "max_abs_diff": max(diffs),
        "max_abs_logit": float(np.abs(logits_of(last["whole"])).max()),
        "same_next_tokens": same_tokens,
        "latency_ms": lat,
        "outside_ms": outside,
        "whole": {**whole_summary, "stats": whole_stats},
        "split": {**split_summary, "stats": stage_stats},
        "ratio": {key: split_summary[key] / whole_summary[key] for key in whole_summary},
        "hops": hops,
    }


def machine_line(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}, {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, device: {device}"


def _mb(value: int | None) -> str:
    if value is None:
        return "—"
    mb = value / 2**20
    return f"{mb:,.0f}" if mb >= 10 else f"{mb:.2f}"


INTRO = """\
# A split instance against a whole one (bench/split_pipeline.py)

A decoder-only transformer with random weights from a seed, served whole in one action runtime process and
split into pipeline stages, each its own runtime process started with the stage variables
(`DILU_STAGE_INDEX`, `DILU_STAGE_COUNT`, `DILU_STAGE_SPAN`) and building only its layers
(`dilu_invoker.actions.pipeline`, docs/runtime.md "Pipeline stages"). Both are driven over HTTP `/init` and
`/run` with the invoker's request bodies; a split request feeds each stage's result to the next stage's
`/run`. Requests are sequential and alternate between whole and split.
"""

CLIENTS = {
    "RuntimeClient": "the invoker's `RuntimeClient`",
    "plain aiohttp": "plain aiohttp requests with the invoker's bodies (the invoker's client was not importable, or `--plain-client`)",
}


def render(raw: dict[str, Any], title: str | None = None) -> str:
    """One run: under the document's title and intro, or (`title`) as a section of a document of several."""
    cfg = raw["config"]
    whole, split = raw["whole"], raw["split"]
    total_weights = sum(s["weights_bytes"] for s in split["stats"])
    lines = [INTRO] if title is None else [f"## {title}", ""]
    lines += [
        f"* machine: {raw['machine']}",
        f"* backend: {raw['backend']}; client: {CLIENTS.get(raw['client'], raw['client'])}"
        + (f"; tensors between stages as {raw['hops_as']}" if raw.get("hops_as") else ""),
        f"* command: `{raw['command']}`",
        f"* time: {raw['utc']}",
        f"* model: {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
        f"{cfg['dtype']} on {cfg['device']}; batch {cfg['batch']} × seq {cfg['seq']} tokens per request; "
        f"{cfg['requests']} requests after {cfg['warmup']} warm-up"
        + (f"; {cfg['cpu_threads']} BLAS/OpenMP thread(s) per process" if cfg.get("cpu_threads") else ""),
    ]
    if raw["gpu_note"]:
        lines.append(f"* GPUs: {raw['gpu_note']}")
    if cfg["device"] == "cpu":
        lines.append("* a dry run on the CPU: it shows the stages compute what the whole does, not what a split costs on GPUs")
    lines += [
        f"* result: split vs whole, max abs difference of the last position's logits {raw['max_abs_diff']:.3g} "
        f"(largest |logit| {raw['max_abs_logit']:.3g}); the same next tokens in every request: "
        f"{'yes' if raw['same_next_tokens'] else 'no'}",
        "",
        "| | p50 ms | p90 ms | max ms |",
        "| --- | ---: | ---: | ---: |",
        f"| whole (1 process) | {whole['p50']:.2f} | {whole['p90']:.2f} | {whole['max']:.2f} |",
        f"| split ({cfg['stages']} stages) | {split['p50']:.2f} | {split['p90']:.2f} | {split['max']:.2f} |",
        f"| split / whole | {raw['ratio']['p50']:.2f}× | {raw['ratio']['p90']:.2f}× | {raw['ratio']['max']:.2f}× |",
        *(f"| {mode}: outside the actions' main (HTTP, runtimes, JSON) | {o['p50']:.2f} | {o['p90']:.2f} | {o['max']:.2f} |"
          for mode, o in ((mode, summary(raw["outside_ms"][mode])) for mode in ("whole", "split"))),
        "",
        "| process | span | layers | weights MB | share of weights | peak GPU MB serving (max_memory_allocated) | peak GPU / whole's | "
        "peak RSS MB | compute ms (last request) | receive + send ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    whole_peak = whole["stats"]["peak_gpu_bytes"]

    def row(name: str, s: dict[str, Any], total: int) -> str:
        a, b = s["span"]
        peak_share = "—" if not whole_peak or s["peak_gpu_bytes"] is None else f"{s['peak_gpu_bytes'] / whole_peak:.1%}"
        return (f"| {name} | {a:g}:{b:g} | {s['layers'][0]}–{s['layers'][1] - 1} | {_mb(s['weights_bytes'])} | "
                f"{s['weights_bytes'] / total:.1%} | {_mb(s['peak_gpu_bytes'])} | {peak_share} | {_mb(s['peak_rss_bytes'])} | "
                f"{s['compute_ms']:.2f} | {s['receive_ms'] + s['send_ms']:.2f} |")

    lines.append(row("whole", whole["stats"], whole["stats"]["weights_bytes"]))
    for s in split["stats"]:
        lines.append(row(f"stage {s['stage']} of {s['count']}", s, total_weights))
    hops = raw["hops"]
    if hops:
        json_bytes = max(h["json_bytes"] for h in hops)
        tensor_bytes = max(h["tensor_bytes"] for h in hops)
        if raw.get("hops_as") == "stage frames":
            lines += ["", f"Intermediate result between stages: a stage frame of {json_bytes / 2**20:.2f} MiB (a tensor "
                          f"of {tensor_bytes / 2**20:.2f} MiB, its bytes as they are) per request."]
        else:
            lines += ["", f"Intermediate result between stages: {json_bytes / 2**20:.2f} MiB of JSON "
                          f"(a tensor of {tensor_bytes / 2**20:.2f} MiB, in base64) per request."]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--backend", choices=("auto", "torch", "numpy"), default="auto",
                    help="the model's library (auto: torch where installed, else numpy on the CPU)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="torch only (default fp16 on CUDA, fp32 on CPU)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each /init and /run")
    ap.add_argument("--cpu-threads", type=int, help="OMP/OpenBLAS/MKL threads of each runtime (default: 1 on --device cpu, "
                    "the libraries' own on cuda)")
    ap.add_argument("--spread-gpus", action="store_true", help="stage k on GPU k (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--plain-client", action="store_true", help="plain aiohttp instead of the invoker's RuntimeClient")
    ap.add_argument("--hops", choices=("frames", "json"), default="frames",
                    help="hand tensors between stages as stage frames where the runtimes take them, as the invoker "
                         "does (default), or as base64 in JSON (the path before stage frames; always with --plain-client)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the runtimes' stdout/stderr")
    ap.add_argument("--out", help="the Markdown report (e.g. docs/benchmarks/split-pipeline.md)")
    ap.add_argument("--json", help="the raw results")
    ap.add_argument("--from-json", action="append", metavar="FILE[=TITLE]",
                    help="render recorded runs (--json files) instead of running, each a section; repeat for several")
    args = ap.parse_args()
    if args.from_json:
        parts = [INTRO]
        for item in args.from_json:
            path, _, title = item.partition("=")
            parts.append(render(json.loads(Path(path).read_text()), title or Path(path).stem))
        text = "\n".join(parts)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
        return 0
    if args.stages < 2 or args.layers < args.stages or args.requests < 1:
        ap.error("need --stages >= 2, --layers >= --stages and --requests >= 1")
    raw = asyncio.run(measure(args))
    text = render(raw)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
