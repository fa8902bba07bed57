"""Where a warm GPU invoke's time goes outside the function: one `dilu-invoker standalone` (its defaults:
process backend, embedded Redis, the GPU manager, the shim, MPS where it runs), four actions created over the
REST API and invoked one after another in batches that alternate between them, so the machine's noise hits
each alike:

* ``cpu-noop``  — ``python:3``, returns at once (the stack's floor);
* ``gpu-noop``  — ``python:3-gpu``, the same code (the GPU kind's path: a GPU instance, its shim, its share);
* ``gpu-tiny``  — ``python:3-gpu``, one tiny torch kernel and a synchronize (a CUDA context in use);
* ``resnet50``  — ``python:3-gpu``, ResNet-50 fp16 batch 8 (bench/gpu_product.py's inference action);
* ``cpu-sleep`` — ``python:3``, sleeps 7 ms (as long as ResNet-50 runs, without a GPU: what the stack's
  processes pay for having slept meanwhile).

The standalone runs at its own log level unless ``--log-level`` says otherwise. Per action: the client's p50
and p99, the function's own time (``run_ms``, measured inside ``main``), the
overhead (client p50 − run p50, the definition of docs/benchmarks/gpu-product.md) and the CPU each process
spends per invoke (the standalone process: REST API, controller, invoker, GPU manager; the runtime proxies;
the action workers; redis-server; this load generator).

    python bench/warm_path.py [--batches 12] [--per 100] [--out FILE.json] [--write]
    python bench/warm_path.py --dry ...    # no GPU: a listed GPU, the actions' CPU fallbacks
    python bench/warm_path.py --from-json RUN1.json[=TITLE],RUN2.json --write    # render recorded runs

With --write the table goes to docs/benchmarks/warm-path.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import shutil
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
sys.path.insert(0, str(ROOT / "tests"))
from ow_support.faults import children

from bench.gpu_product import INFER_CODE, NOOP_CODE
from bench.loadgen import cpu_by_part, cpu_ms_per, percentile, put_gpu_action, stop_process_tree
from bench.standalone import GUEST, free_port, wait_http

TINY_CODE = r'''
import time
try:
    import torch
except ImportError:
    torch = None
_x = []

def main(args):
    t0 = time.perf_counter()
    if torch is not None and torch.cuda.is_available():
        if not _x:
            _x.append(torch.ones(1, device="cuda"))
        (_x[0] + 1).sum().item()
    return {"gpu_ms": 0.0, "run_ms": (time.perf_counter() - t0) * 1000}
'''



SLEEP_CODE = r'''
import time

def main(args):
    t0 = time.perf_counter()
    time.sleep(float(args.get("sleep_ms", 7)) / 1000)
    return {"gpu_ms": 0.0, "run_ms": (time.perf_counter() - t0) * 1000}
'''


def gpu_annotations(request: float, limit: float) -> list[dict[str, Any]]:
    return [{"key": "gpu-class", "value": "inference"}, {"key": "gpu-sm-request", "value": request},
            {"key": "gpu-sm-limit", "value": limit}, {"key": "gpu-memory-mb", "value": 2048}]


#: name: (kind, code, params, GPU annotations). ResNet-50 has bench/gpu_product.py's SM request and limit; the two
#: small ones take little, so all three fit one GPU under the default γ (Σ limit 1.4 ≤ 1.5).
ACTIONS: dict[str, tuple[str, str, dict[str, Any], list[dict[str, Any]]]] = {
    "cpu-noop": ("python:3", NOOP_CODE, {}, []),
    "gpu-noop": ("python:3-gpu", NOOP_CODE, {}, gpu_annotations(0.1, 0.3)),
    "gpu-tiny": ("python:3-gpu", TINY_CODE, {}, gpu_annotations(0.1, 0.3)),
    "resnet50": ("python:3-gpu", INFER_CODE, {"model": "resnet50", "batch": 8}, gpu_annotations(0.5, 0.8)),
    "cpu-sleep": ("python:3", SLEEP_CODE, {"sleep_ms": 7}, []),
}


async def invoke(session: aiohttp.ClientSession, url: str, params: dict[str, Any]) -> tuple[float, float]:
    t = time.perf_counter()
    async with session.post(f"{url}?blocking=true&result=true", json=params) as r:
        body = await r.read()
        status = r.status
    ms = (time.perf_counter() - t) * 1000
    data = json.loads(body) if status == 200 else None
    if not isinstance(data, dict) or "run_ms" not in data:
        raise RuntimeError(f"{url} answered {status}: {body[:300]!r}")
    return ms, float(data["run_ms"])


class SocketClient:
    """The leanest client: HTTP/1.1 on one kept, blocking socket (no event loop, no client library), so that
    its own time in the client p50 is a few µs, where aiohttp's is ~0.4 ms of CPU per invoke on these
    machines. The invokes are sequential, so blocking the bench's loop holds nothing up."""

    def __init__(self, host: str, port: int, user: str, key: str) -> None:
        self.host, self.port = host, port
        self.auth = base64.b64encode(f"{user}:{key}".encode()).decode()
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the API closed the connection")
        self.buf += chunk

    def post(self, path: str, payload: Any) -> tuple[int, bytes]:
        body = json.dumps(payload).encode()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Basic {self.auth}"
                          f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" not in fields:
            raise RuntimeError(f"no Content-Length in the answer: {head!r}")
        length = int(fields["content-length"])
        while len(self.buf) < length:
            self._more()
        out, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split(" ", 2)[1]), out

    def close(self) -> None:
        self.sock.close()


def invoke_socket(client: SocketClient, path: str, params: dict[str, Any]) -> tuple[float, float]:
    t = time.perf_counter()
    status, body = client.post(f"{path}?blocking=true&result=true", params)
    ms = (time.perf_counter() - t) * 1000
    data = json.loads(body) if status == 200 else None
    if not isinstance(data, dict) or "run_ms" not in data:
        raise RuntimeError(f"{path} answered {status}: {body[:300]!r}")
    return ms, float(data["run_ms"])


def row_name(action: str, client: str) -> str:
    """A summary row: the action's name for the aiohttp client (as in the first runs), `name · socket` else."""
    return action if client == "aiohttp" else f"{action} · {client}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="dilu-warm-")
    port = free_port()
    flags = ["--data-dir", data_dir, "--api-port", str(port), "--invoker-user-memory-mb", "32768"]
    if args.dry:
        inventory = Path(data_dir) / "inventory.json"
        inventory.write_text(json.dumps([{"uuid": "GPU-dry-run-0", "name": "dry-run GPU", "memory_mb": 81920}]))
        flags += ["--gpu-inventory", str(inventory), "--gpu-mps", "off"]
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + inherited if inherited else "")}
    env.pop("DILU_LOG_LEVEL", None)
    if args.log_level:
        env["DILU_LOG_LEVEL"] = args.log_level
    server = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "standalone", *flags], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    names = [n for n in args.actions.split(",") if n]
    api = f"http://127.0.0.1:{port}/api/v1/namespaces/_/actions"
    user, key = GUEST.split(":")
    clients = [c for c in args.clients.split(",") if c]
    unknown = set(clients) - {"aiohttp", "socket"}
    if unknown or not clients:
        raise SystemExit(f"--clients: aiohttp and/or socket, not {args.clients!r}")
    out: dict[str, Any] = {row_name(n, c): {"client_ms": [], "run_ms": [], "cpu": [], "batch_overhead_ms": []}
                           for n in names for c in clients}
    lean: SocketClient | None = None
    try:
        async with aiohttp.ClientSession(auth=aiohttp.BasicAuth(user, key)) as session:
            await wait_http(session, f"http://127.0.0.1:{port}/api/v1", 90)
            for name in names:
                kind, code, _, annotations = ACTIONS[name]
                if kind == "python:3":
                    body = {"exec": {"kind": kind, "code": code}, "limits": {"memory": 256}}
                    async with session.put(f"{api}/{name}?overwrite=true", json=body) as r:
                        assert r.status == 200, await r.text()
                else:
                    await put_gpu_action(session, api, name, code, annotations, memory_mb=4096)
            params = {n: {**ACTIONS[n][2], **({"dry": True} if args.dry else {})} for n in names}
            for name in names:  # cold start and warm-up (lazy kernels, allocator, connections)
                for _ in range(args.warmup):
                    await invoke(session, f"{api}/{name}", params[name])
            if "socket" in clients:
                lean = SocketClient("127.0.0.1", port, user, key)
                for name in names:
                    for _ in range(5):
                        invoke_socket(lean, f"/api/v1/namespaces/_/actions/{name}", params[name])
            for _ in range(args.batches):
                for name in names:
                    for client in clients:
                        row = out[row_name(name, client)]
                        before = cpu_by_part(server.pid, children(server.pid))
                        if client == "socket":
                            assert lean is not None
                            path = f"/api/v1/namespaces/_/actions/{name}"
                            batch = [invoke_socket(lean, path, params[name]) for _ in range(args.per)]
                        else:
                            batch = [await invoke(session, f"{api}/{name}", params[name]) for _ in range(args.per)]
                        row["client_ms"] += [ms for ms, _ in batch]
                        row["run_ms"] += [run_ms for _, run_ms in batch]
                        row["batch_overhead_ms"].append(round(statistics.median(ms for ms, _ in batch)
                                                              - statistics.median(r for _, r in batch), 3))
                        row["cpu"].append(cpu_ms_per(before, cpu_by_part(server.pid, children(server.pid)),
                                                     args.per))
    finally:
        if lean is not None:
            lean.close()
        await stop_process_tree(server, grace_s=30)
        shutil.rmtree(data_dir, ignore_errors=True)
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, r in raw.items():
        client, run_ms = r["client_ms"], r["run_ms"]
        cpu = {part: round(statistics.median(b[part] for b in r["cpu"]), 3) for part in r["cpu"][0]}
        p50, run50 = statistics.median(client), statistics.median(run_ms)
        rows[name] = {"n": len(client), "p50_ms": round(p50, 3), "p99_ms": round(percentile(client, 0.99), 3),
                      "run_p50_ms": round(run50, 3), "overhead_p50_ms": round(p50 - run50, 3),
                      "batch_overhead_ms": r["batch_overhead_ms"],
                      "cpu_ms_per_invoke": cpu}
    return rows


PREAMBLE = """# Warm path: where a warm invoke's time goes outside the function

Written by `bench/warm_path.py` (its docstring says what each action is). One standalone with its defaults
per run, except in runs 1 and 2 below its log level (`DILU_LOG_LEVEL=warning`; the default, info, adds the
invoker's one `activation finished` line per invoke: 28 µs of CPU on the 2-core development VM; `--log-level`
sets it now, the default leaves it alone); the actions' batches alternate, so the machine's noise hits each
alike. *Overhead* is the client's
p50 less the function's own p50 (`run_ms`, timed inside `main`), the definition of issue 13's target and of
docs/benchmarks/gpu-product.md. CPU is per invoke, the median over batches, from `/proc` (10 ms ticks over
batches of 100 invokes: 0.1 ms resolution), and includes what each process does in the background meanwhile
(the GPU manager's 50 ms ticks, lease renewals), so it grows with the time an invoke takes.

The differences below each table split the overhead:

* *GPU kind*: `gpu-noop` − `cpu-noop`, the same code on a GPU instance (its share, its shim, MPS client);
* *sleeping*: `cpu-sleep` − `cpu-noop`, what the stack's processes pay for having slept while the function
  ran (their wake-ups on the way back: runtime proxy, standalone, client);
* *GPU work*: `resnet50` − `cpu-sleep`, what is left once a function of the same length is accounted for.

Runs 3 and 4 each ran in one call on one fresh H200 machine (`bench/h200_warm.sh`), alternating rounds of
this tree and of commit 17a2a38 (the product before the warm-path work, with this bench script): the ratio
between trees in one call is what counts, the machines are noisy. Run 3 is before the direct lane (a warm
/run from the invoker straight to the initialised worker, docs/runtime.md); run 4 has it, and adds this
tree with the lane off (`DILU_INVOKER_PROCESS_DIRECT_LANE=false`) in each round. Run 5 is one more round of
the direct lane beside 17a2a38 on another fresh machine (slower: 17a2a38's ResNet-50 overhead 3.31 ms there
against 2.65–2.89 in run 4).
"""


def derived(rows: dict[str, Any]) -> list[str]:
    out = []
    for client in ("aiohttp", "socket"):
        def diff(a: str, b: str, client: str = client) -> str:
            a, b = row_name(a, client), row_name(b, client)
            if a not in rows or b not in rows:
                return "n/a"
            return f"{rows[a]['overhead_p50_ms'] - rows[b]['overhead_p50_ms']:+.3f} ms"
        if any(name == row_name(name.split(" · ")[0], client) for name in rows):
            out.append(f"* {client} client: GPU kind: {diff('gpu-noop', 'cpu-noop')}; sleeping: "
                       f"{diff('cpu-sleep', 'cpu-noop')}; GPU work: {diff('resnet50', 'cpu-sleep')}")
    return out


def render_run(title: str, rows: dict[str, Any], cmd: str, machine: str) -> str:
    parts = list(next(iter(rows.values()))["cpu_ms_per_invoke"])
    lines = [f"## {title}", "", f"Machine: {machine}. Command: `{cmd}`.", "",
             "| action | invokes | client p50 (ms) | client p99 (ms) | run p50 (ms) | overhead p50 (ms) | "
             "overhead per batch, min–max (ms) | " + " | ".join(f"CPU {p} (ms/invoke)" for p in parts) + " |",
             "| --- " * (7 + len(parts)) + "|"]
    for name, r in rows.items():
        cpu = r["cpu_ms_per_invoke"]
        lines.append(f"| {name} | {r['n']} | {r['p50_ms']} | {r['p99_ms']} | {r['run_p50_ms']} | "
                     f"{r['overhead_p50_ms']} | {min(r['batch_overhead_ms'])}–{max(r['batch_overhead_ms'])} | "
                     + " | ".join(str(cpu[p]) for p in parts) + " |")
    return "\n".join([*lines, "", *derived(rows)]) + "\n"


def render_summary(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per run: the overhead p50 of the no-op and ResNet-50 actions with each client, against the
    issue's 2 ms target for a GPU action."""
    cols = [(a, c) for a in ("cpu-noop", "resnet50") for c in ("aiohttp", "socket")]
    lines = ["## Summary: overhead p50 (ms) per run", "",
             "| run | " + " | ".join(f"{a} · {c}" for a, c in cols) + " |", "| --- " * (1 + len(cols)) + "|"]
    for title, rows in runs:
        cells = [f"{rows[row_name(a, c)]['overhead_p50_ms']:.2f}" if row_name(a, c) in rows else "—"
                 for a, c in cols]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def machine_line() -> str:
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}" + (f", {gpu}" if gpu else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actions", default=",".join(ACTIONS))
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--per", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--clients", default="aiohttp,socket",
                    help="the load generator's clients, each in batches of its own: aiohttp (the bench's other "
                    "clients), socket (HTTP/1.1 on a blocking socket: the stack's overhead without a client's)")
    ap.add_argument("--log-level", default="", help="the standalone's DILU_LOG_LEVEL (default: its own, info; "
                    "the runs of 2026-12-02 used warning)")
    ap.add_argument("--dry", action="store_true", help="no GPU here: a listed GPU, the actions' CPU fallbacks")
    ap.add_argument("--out", help="raw samples and the summary as JSON")
    ap.add_argument("--from-json", help="render these runs instead of running: --out files, comma-separated, "
                    "each FILE or FILE=TITLE")
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks/warm-path.md")
    args = ap.parse_args()
    if args.from_json:
        sections, runs = [], []
        for i, item in enumerate(args.from_json.split(",")):
            path, _, title = item.partition("=")
            r = json.loads(Path(path).read_text())
            runs.append((title.split(" (")[0] or Path(path).name, r["summary"]))
            sections.append(render_run(f"Run {i + 1}: {title or Path(path).name}", r["summary"], r["command"],
                                       r.get("machine", "?")))
        sections.insert(0, render_summary(runs))
    else:
        raw = asyncio.run(run(args))
        # the standalone inherits the environment: its DILU_* settings belong to the command
        env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("DILU_")]
        cmd = " ".join([*env, "python bench/warm_path.py", *sys.argv[1:]])
        result = {"machine": machine_line(), "command": cmd, "summary": summarize(raw), "raw": raw}
        if args.out:
            Path(args.out).write_text(json.dumps(result))
        sections = [render_run("This run", result["summary"], cmd, result["machine"])]
    text = "\n".join([PREAMBLE, *sections])
    print(text)
    if args.write:
        (ROOT / "docs" / "benchmarks" / "warm-path.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
