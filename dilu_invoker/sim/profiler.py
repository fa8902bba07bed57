"""`dilu-invoker profile`: measure latency and throughput over SM share × batch size on a real GPU.

The search is the policy package's (`hybrid_growth_search`, `grid_search`, `training_search`); this
module runs the measurements it asks for in worker processes (profile_worker.py) whose SM share is
held by a `ShareControl`:

* `shim` (preferred): the worker runs with the CUDA shim preloaded and its share is written to the
  shim's control block between measurements (one worker serves every share);
* `mps`: MPS's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, fixed when a process creates its CUDA context, so
  one worker per share; the profiler starts a private MPS control daemon (its own pipe directory)
  unless `--mps-external` says one is running, and stops it at the end;
* `none`: nothing holds the share (only for `--dry-run`, whose formula worker takes the share as a
  parameter).

`auto` takes the shim when its library and the control-block ABI are present, else MPS.
Outputs: the profile JSON (docs/simulator.md "profiles.json"), the recommended `<request, limit>` and
batch per model on stdout, and with `--runs` every probe of every search with timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from dilu_invoker.policy import (
    InstanceClass,
    Measurement,
    SearchConfig,
    SearchResult,
    grid_search,
    hybrid_growth_search,
    training_search,
)

MODELS: dict[str, InstanceClass] = {
    "resnet50": InstanceClass.INFERENCE,
    "bert-base": InstanceClass.INFERENCE,
    "train-resnet50": InstanceClass.TRAINING,
}
DEFAULT_SLO_MS = 50.0
"""Dilu's profiler default QoS target (HGSS.sh: 0.05 s)."""
DEFAULT_TRAINING_BATCH = 32


class ProfilerError(Exception):
    """Printed as one line; exit status 2."""


# -- share control ---------------------------------------------------------------------------------


class ShareControl(Protocol):
    name: str
    per_process: bool
    """True: the share is fixed per process (one worker per share)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def worker_env(self, share: float | None) -> dict[str, str]: ...

    def apply(self, worker: _Worker, share: float, batch: int, request: dict[str, Any]) -> None:
        """Hold ``share`` for the next measurement of ``batch`` (``request``: that measurement, which a
        control may first run unlimited to calibrate)."""
        ...


class NoShareControl:
    name = "none"
    per_process = False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def worker_env(self, share: float | None) -> dict[str, str]:
        return {}

    def apply(self, worker: _Worker, share: float, batch: int, request: dict[str, Any]) -> None:
        pass


class MpsShareControl:
    """One MPS client per share: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the SMs it may use."""

    name = "mps"
    per_process = True

    def __init__(self, *, external: bool = False, control: str = "nvidia-cuda-mps-control") -> None:
        self.external = external
        self.control = control
        self.dir: Path | None = None
        self.env: dict[str, str] = {}

    def start(self) -> None:
        if self.external:
            self.env = {k: os.environ[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY") if k in os.environ}
            return
        exe = shutil.which(self.control)
        if exe is None:
            raise ProfilerError(f"{self.control} not found: MPS is needed to hold SM shares (or use --share-control shim)")
        self.dir = Path(tempfile.mkdtemp(prefix="dilu-mps-"))
        (self.dir / "pipe").mkdir()
        (self.dir / "log").mkdir()
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.dir / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.dir / "log"),
        }
        rc = subprocess.run([exe, "-d"], check=False, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
        if rc.returncode != 0:
            raise ProfilerError(f"cannot start the MPS control daemon: {rc.stderr.strip() or rc.stdout.strip()}")
        time.sleep(0.5)

    def stop(self) -> None:
        if self.external or self.dir is None:
            return
        exe = shutil.which(self.control)
        if exe is not None:
            try:
                subprocess.run([exe], check=False, input="quit\n", env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def worker_env(self, share: float | None) -> dict[str, str]:
        assert share is not None
        pct = max(1, min(100, round(share * 100)))
        return {**self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}

    def apply(self, worker: _Worker, share: float, batch: int, request: dict[str, Any]) -> None:
        pass  # fixed at the worker's start


class ShimShareControl:
    """One worker under the shim; its share is a launch rate written into its control block.

    A share is what the live system enforces (`dilu_invoker.gpu.abi.Quota.from_share`): share × the
    thread blocks per millisecond the workload launches with the GPU to itself. That capacity depends on
    the batch, so the first probe of each batch size is preceded by the same measurement run unlimited,
    counting the blocks the shim saw (`calibrations` keeps them, with their cost).
    """

    name = "shim"
    per_process = False

    def __init__(self, library: Path) -> None:
        if not library.is_file():
            raise ProfilerError(f"shim library {library} not found (build it with `make -C cuda_shim`)")
        self.library = library
        self.dir: Path | None = None
        self.control: Any = None
        self.stats: Any = None
        self.capacity: dict[tuple[str, int], float] = {}
        self.calibrations: list[dict[str, Any]] = []

    def start(self) -> None:
        from dilu_invoker.gpu import abi

        self.dir = Path(tempfile.mkdtemp(prefix="dilu-shim-"))
        # Never stale: no manager heartbeats here, the profiler writes every share itself.
        self.control, self.stats = abi.create_instance_files(self.dir, "profile", abi.Quota(stale_after_ns=0))

    def stop(self) -> None:
        for block in (self.control, self.stats):
            if block is not None:
                block.close()
        self.control = self.stats = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def worker_env(self, share: float | None) -> dict[str, str]:
        from dilu_invoker.gpu import shim

        assert self.dir is not None
        files = self.dir / "profile"
        return {"LD_PRELOAD": str(self.library), shim.ENV_CONTROL: str(files / "control"),
                shim.ENV_STATS: str(files / "stats")}

    def _blocks(self) -> int:
        return int(self.stats.snapshot().blocks)

    def _write(self, quota: Any) -> None:
        self.control.write(quota)
        time.sleep(0.02)  # the shim re-reads its block at its next launch window (5 ms)

    def apply(self, worker: _Worker, share: float, batch: int, request: dict[str, Any]) -> None:
        from dilu_invoker.gpu import abi

        key = (str(request.get("model")), batch)
        if key not in self.capacity:
            self._write(abi.Quota(stale_after_ns=0))
            t0 = time.perf_counter()
            # Once unlimited to load and warm up (allocations, autotuning: launches that are no step),
            # then counted: every iteration, warm-up included, launches the same kernels, and the timed
            # ones say how long one takes with the GPU to itself.
            worker.call({**request, "share": 1.0, "min_iters": 1, "max_iters": 1})
            b0 = self._blocks()
            r = worker.call({**request, "share": 1.0})
            blocks = self._blocks() - b0
            steps = int(request.get("warmup", 0)) + int(r.get("iters", 0))
            step_ms = float(r["latency_ms"])
            if blocks <= 0 or steps <= 0 or step_ms <= 0:
                raise ProfilerError("the shim counted no thread blocks: is the worker running under it "
                                    "(LD_PRELOAD) with a GPU?")
            self.capacity[key] = blocks / steps / step_ms
            self.calibrations.append({"model": key[0], "batch": batch, "blocks": blocks, "steps": steps,
                                      "step_ms": round(step_ms, 4),
                                      "seconds": round(time.perf_counter() - t0, 3),
                                      "capacity_blocks_per_ms": round(self.capacity[key], 3)})
        self._write(abi.Quota.from_share(share, self.capacity[key], stale_after_ns=0))


def make_share_control(kind: str, *, shim_lib: Path, mps_external: bool) -> ShareControl:
    if kind == "none":
        return NoShareControl()
    if kind == "mps":
        return MpsShareControl(external=mps_external)
    if kind == "shim":
        return ShimShareControl(shim_lib)
    try:
        return ShimShareControl(shim_lib)
    except ProfilerError:
        return MpsShareControl(external=mps_external)


# -- workers ---------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, args: Sequence[str], env: dict[str, str], log: IO[str] | None) -> None:
        self.proc = subprocess.Popen(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            text=True,
            env={**os.environ, **env},
        )

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ProfilerError(f"profiler worker exited (status {self.proc.poll()})") from None
        line = self.proc.stdout.readline()
        if not line:
            raise ProfilerError(f"profiler worker exited (status {self.proc.wait()}); see its log")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise ProfilerError(f"worker: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()


class WorkerPool:
    """Workers keyed by share (per-process control) or one worker (run-time control)."""

    def __init__(self, control: ShareControl, worker_args: Sequence[str], log: IO[str] | None) -> None:
        self.control = control
        self.args = list(worker_args)
        self.log = log
        self.workers: dict[float | None, _Worker] = {}
        self.started = 0

    def _key(self, share: float) -> float | None:
        return round(share, 4) if self.control.per_process else None

    def prestart(self, shares: Sequence[float]) -> None:
        """Start the workers of these shares at once: model loading then overlaps."""
        for s in shares:
            key = self._key(s)
            if key not in self.workers:
                self.workers[key] = _Worker(self.args, self.control.worker_env(key), self.log)
                self.started += 1

    def get(self, share: float) -> _Worker:
        key = self._key(share)
        w = self.workers.get(key)
        if w is None:
            self.prestart([share])
            w = self.workers[key]
        return w

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers.clear()


# -- measuring -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    warmup: int = 3
    min_iters: int = 5
    max_iters: int = 50
    min_time_s: float = 0.25


@dataclass(slots=True)
class Probe:
    share: float
    batch: int
    latency_ms: float
    throughput_rps: float
    latency_p90_ms: float
    iters: int
    memory_mib: float | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "sm_share": self.share,
            "batch": self.batch,
            "latency_ms": round(self.latency_ms, 4),
            "latency_p90_ms": round(self.latency_p90_ms, 4),
            "throughput_rps": round(self.throughput_rps, 3),
            "iters": self.iters,
            "memory_mib": None if self.memory_mib is None else round(self.memory_mib, 1),
            "seconds": round(self.seconds, 3),
        }


class Measurer:
    """`measure(share, batch)` for the policy's searches; records every probe with its cost."""

    def __init__(self, pool: WorkerPool, model: str, options: MeasureOptions, echo: Callable[[str], None]) -> None:
        self.pool = pool
        self.model = model
        self.options = options
        self.echo = echo
        self.probes: list[Probe] = []

    def __call__(self, share: float, batch: int) -> Measurement:
        w = self.pool.get(share)
        request = {
            "op": "measure",
            "model": self.model,
            "batch": batch,
            "share": share,
            "warmup": self.options.warmup,
            "min_iters": self.options.min_iters,
            "max_iters": self.options.max_iters,
            "min_time_s": self.options.min_time_s,
        }
        self.pool.control.apply(w, share, batch, request)
        t0 = time.perf_counter()
        r = w.call(request)
        p = Probe(
            share=share,
            batch=batch,
            latency_ms=float(r["latency_ms"]),
            throughput_rps=float(r["throughput_rps"]),
            latency_p90_ms=float(r.get("latency_p90_ms", r["latency_ms"])),
            iters=int(r.get("iters", 0)),
            memory_mib=r.get("memory_mib"),
            seconds=time.perf_counter() - t0,
        )
        self.probes.append(p)
        self.echo(
            f"  {self.model:16s} share {share:4.2f} batch {batch:3d}: {p.latency_ms:9.2f} ms  "
            f"{p.throughput_rps:10.1f} req/s  ({p.iters} iters, {p.seconds:.1f} s)"
        )
        return Measurement(share, batch, p.latency_ms, p.throughput_rps)


def _result_json(r: SearchResult, probes: list[Probe], seconds: float) -> dict[str, Any]:
    best = r.best
    return {
        "method": r.method,
        "feasible": r.feasible,
        "request": r.request,
        "limit": r.limit,
        "batch": r.batch,
        "best": None
        if best is None
        else {
            "sm_share": best.share,
            "batch": best.batch,
            "latency_ms": round(best.latency_ms, 4),
            "throughput_rps": round(best.throughput_rps, 3),
            "efficiency": round(best.efficiency, 3),
        },
        "probes": len(probes),
        "seconds": round(seconds, 2),
        "reason": r.reason,
        "points": [p.to_json() for p in probes],
    }


def profile_model(
    pool: WorkerPool,
    model: str,
    *,
    cls: InstanceClass,
    slo_ms: float | None,
    training_batch: int,
    config: SearchConfig,
    options: MeasureOptions,
    search: bool,
    grid: bool,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """Run the search and/or the grid for one model; the profile entry plus raw runs."""
    runs: dict[str, Any] = {}
    grid_probes: list[Probe] = []
    recommended: SearchResult | None = None
    training = cls is InstanceClass.TRAINING
    tconfig = SearchConfig(
        step=config.step, batches=(training_batch,), limit_gain=config.limit_gain,
        training_fraction=config.training_fraction,
    )
    if search:
        m = Measurer(pool, model, options, echo)
        echo(f"{model}: {'training search' if training else 'hybrid growth search'}")
        t0 = time.perf_counter()
        if training:
            r = training_search(m, batch=training_batch, config=tconfig)
        else:
            assert slo_ms is not None
            r = hybrid_growth_search(m, slo_ms=slo_ms, config=config)
        runs["search"] = _result_json(r, m.probes, time.perf_counter() - t0)
        recommended = r
        echo(f"{model}: search → request {r.request:.2f}, limit {r.limit:.2f}, batch {r.batch} ({len(m.probes)} probes): {r.reason}")
        search_probes = m.probes
    else:
        search_probes = []
    if grid:
        m = Measurer(pool, model, options, echo)
        echo(f"{model}: exhaustive grid")
        t0 = time.perf_counter()
        r = grid_search(m, slo_ms=None if training else slo_ms, config=tconfig if training else config)
        runs["grid"] = _result_json(r, m.probes, time.perf_counter() - t0)
        if recommended is None:
            recommended = r
        grid_probes = m.probes
        echo(f"{model}: grid → request {r.request:.2f}, limit {r.limit:.2f}, batch {r.batch} ({len(m.probes)} probes): {r.reason}")
    assert recommended is not None
    points = grid_probes or search_probes
    mems = [p.memory_mib for p in points if p.batch == recommended.batch and p.memory_mib is not None]
    memory = max(mems) if mems else max((p.memory_mib or 0.0 for p in points), default=0.0) or 1024.0
    entry: dict[str, Any] = {"class": cls.value, "memory_mib": round(memory, 1)}
    if slo_ms is not None and not training:
        entry["slo_ms"] = slo_ms
    entry["points"] = [
        {"sm_share": p.share, "batch": p.batch, "latency_ms": round(p.latency_ms, 4), "throughput_rps": round(p.throughput_rps, 3)}
        for p in points
    ]
    entry["recommended"] = {"request": recommended.request, "limit": recommended.limit, "batch": recommended.batch}
    entry["recommended_by"] = recommended.method
    return {"entry": entry, "runs": runs}


# -- the command -----------------------------------------------------------------------------------


def _shares(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return v


def _gain(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return v


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dilu-invoker profile",
        description="Measure latency and throughput over SM share x batch size (docs/simulator.md, 'Profiler').",
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", action="append", choices=sorted(MODELS), help="repeat for several models")
    what.add_argument("--action", type=Path, help="an OpenWhisk action file whose main(params) takes {'batch': b}")
    what.add_argument("--replay", type=Path, metavar="PROFILES",
                      help="no GPU: re-run the searches over the points of a measured profile set (e.g. with "
                           "another --limit-gain) and write it with the new recommendations to --out")
    ap.add_argument("--name", default=None, help="profile name of --action (default: the file's stem)")
    ap.add_argument("--class", dest="cls", choices=[c.value for c in InstanceClass], default="inference",
                    help="class of --action")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--exhaustive", action="store_true", help="measure the full share x batch grid")
    mode.add_argument("--compare", action="store_true", help="run the search and the grid (how close is the search?)")
    ap.add_argument("--slo-ms", type=float, default=DEFAULT_SLO_MS)
    ap.add_argument("--step", type=_shares, default=0.1, help="share grid step")
    ap.add_argument("--batches", type=_batches, default=(1, 2, 4, 8, 16, 32, 64))
    ap.add_argument("--training-batch", type=int, default=DEFAULT_TRAINING_BATCH)
    ap.add_argument("--limit-gain", type=_gain, default=SearchConfig().limit_gain,
                    help="raise the limit while one more share step adds at least this fraction of throughput")
    ap.add_argument("--share-control", choices=("auto", "shim", "mps", "none"), default="auto")
    ap.add_argument("--shim-lib", type=Path, default=Path(os.environ.get("DILU_SHIM_LIB", "cuda_shim/build/libdilu_shim.so")))
    ap.add_argument("--mps-external", action="store_true", help="use the MPS daemon named by CUDA_MPS_PIPE_DIRECTORY")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="inference precision")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--window-s", type=float, default=0.25, help="measure each point for at least this long")
    ap.add_argument("--prestart", action="store_true", help="start every share's worker up front (MPS)")
    ap.add_argument("--out", type=Path, default=Path("profiles.json"))
    ap.add_argument("--runs", type=Path, default=None, help="write every probe of every search here")
    ap.add_argument("--worker-log", type=Path, default=None, help="workers' stderr (default: discarded)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: a latency formula stands in for the model (output labelled synthetic)")
    ap.add_argument("--formula-scale", type=float, default=1.0, help="dry run: scale the formula's sleeps")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command = "dilu-invoker profile " + shlex.join(argv)
    try:
        return _run(args)
    except ProfilerError as exc:
        print(f"dilu-invoker profile: error: {exc}", file=sys.stderr)
        return 2


def replay(doc: dict[str, Any], *, limit_gain: float, slo_ms: float, echo: Callable[[str], None]) -> dict[str, Any]:
    """The profile set `doc` with every recommendation re-derived by the searches from its measured points
    (a point the search asks for and the set lacks is an error)."""
    from dilu_invoker.sim.profiles import parse_profiles

    profiles = parse_profiles(doc)
    out = json.loads(json.dumps(doc))
    for name, prof in profiles.functions.items():
        table = {(round(p.sm_share, 4), p.batch): p for p in prof.points}
        shares = sorted({k[0] for k in table})
        batches = tuple(sorted({k[1] for k in table}))
        step = shares[0]

        def measure(share: float, batch: int, table: dict[tuple[float, int], Any] = table, name: str = name) -> Measurement:
            p = table.get((round(share, 4), batch))
            if p is None:
                raise ProfilerError(f"{name}: no measured point at share {share:.2f}, batch {batch}")
            return Measurement(share, batch, p.latency_ms, p.throughput_rps)

        config = SearchConfig(step=step, batches=batches, max_batch=max(batches), limit_gain=limit_gain)
        if prof.cls is InstanceClass.TRAINING:
            r = training_search(measure, batch=prof.recommended.batch, config=config)
        else:
            r = hybrid_growth_search(measure, slo_ms=prof.slo_ms or slo_ms, config=config)
        out["functions"][name]["recommended"] = {"request": r.request, "limit": r.limit, "batch": r.batch}
        out["functions"][name]["recommended_by"] = f"{r.method} (replayed over the measured points)"
        echo(f"{name}: {r.method} → request {r.request:.2f}, limit {r.limit:.2f}, batch {r.batch}: {r.reason}")
    out["source"] = (f"{doc.get('source', '')}; recommendations replayed with limit_gain {limit_gain:g} "
                     f"on {time.strftime('%Y-%m-%d', time.gmtime())}")
    return out


def _run(args: argparse.Namespace) -> int:
    echo: Callable[[str], None] = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    if args.replay is not None:
        try:
            doc = json.loads(args.replay.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ProfilerError(f"cannot read {args.replay}: {exc}") from None
        try:
            out = replay(doc, limit_gain=args.limit_gain, slo_ms=args.slo_ms, echo=echo)
        except ValueError as exc:  # ProfileError and bad settings
            raise ProfilerError(str(exc)) from None
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        echo(f"wrote {args.out}")
        return 0
    if args.action is not None:
        if not args.action.is_file():
            raise ProfilerError(f"action file {args.action} not found")
        name = args.name or args.action.stem
        targets = [(name, f"action:{args.action.resolve()}", InstanceClass(args.cls))]
    else:
        targets = [(m, m, MODELS[m]) for m in dict.fromkeys(args.model)]
    if args.dry_run:
        if args.action is not None:
            raise ProfilerError("--dry-run profiles the built-in models' formulas, not an action")
        targets = [(n, f"formula:{n}", c) for n, _, c in targets]
        # The formula takes the share as a parameter; an explicit `--share-control shim` drives the real
        # shim instead (its workers then launch through libcuda.so.1: the tests' fake driver).
        control: ShareControl = (ShimShareControl(args.shim_lib) if args.share_control == "shim"
                                 else NoShareControl())
    else:
        control = make_share_control(args.share_control, shim_lib=args.shim_lib, mps_external=args.mps_external)
        if control.name == "none":
            echo("WARNING: --share-control none: nothing holds the SM share; every point runs on the whole GPU")
    config = SearchConfig(step=args.step, batches=args.batches, max_batch=max(args.batches), limit_gain=args.limit_gain)
    options = MeasureOptions(args.warmup, args.min_iters, args.max_iters, args.window_s)
    worker_args = [
        sys.executable, "-m", "dilu_invoker.sim.profile_worker",
        "--device", str(args.device), "--dtype", args.dtype, "--formula-scale", str(args.formula_scale),
    ]
    log: IO[str] | None = args.worker_log.open("a", encoding="utf-8") if args.worker_log else None
    search = not args.exhaustive
    grid = args.exhaustive or args.compare
    t_start = time.perf_counter()
    functions: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    info: dict[str, Any] = {}
    control.start()
    pool = WorkerPool(control, worker_args, log)
    try:
        if args.prestart and control.per_process:
            pool.prestart(config.shares())
        info = pool.get(1.0).call({"op": "info"})
        echo(f"share control: {control.name}; device: {info.get('device', 'none')}; torch {info.get('torch')}")
        for name, model, cls in targets:
            out = profile_model(
                pool,
                model,
                cls=cls,
                slo_ms=None if cls is InstanceClass.TRAINING else args.slo_ms,
                training_batch=args.training_batch,
                config=config,
                options=options,
                search=search,
                grid=grid,
                echo=echo,
            )
            functions[name] = out["entry"]
            runs[name] = out["runs"]
    finally:
        pool.close()
        control.stop()
        if log is not None:
            log.close()
    wall = time.perf_counter() - t_start
    synthetic = bool(args.dry_run)
    doc = {
        "format": "dilu-profiles",
        "version": 1,
        "synthetic": synthetic,
        "source": ("SYNTHETIC dry run (latency formula, no GPU)" if synthetic else "measured")
        + f" by `dilu-invoker profile` with share control {control.name} on {time.strftime('%Y-%m-%d', time.gmtime())}",
        "device": info.get("device", "none"),
        "functions": functions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.runs is not None:
        args.runs.parent.mkdir(parents=True, exist_ok=True)
        args.runs.write_text(
            json.dumps(
                {
                    "synthetic": synthetic,
                    "share_control": control.name,
                    "environment": info,
                    "command": args.command,
                    "slo_ms": args.slo_ms,
                    "shares": list(config.shares()),
                    "batches": list(config.batch_sizes()),
                    "training_batch": args.training_batch,
                    "measure": {"warmup": options.warmup, "min_iters": options.min_iters,
                                "max_iters": options.max_iters, "min_time_s": options.min_time_s},
                    "workers_started": pool.started,
                    "calibrations": getattr(control, "calibrations", None),
                    "wall_s": round(wall, 2),
                    "models": runs,
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )
    print(f"{'profile':16s} {'request':>7s} {'limit':>6s} {'batch':>5s}  by")
    for name, entry in functions.items():
        rec = entry["recommended"]
        print(f"{name:16s} {rec['request']:7.2f} {rec['limit']:6.2f} {rec['batch']:5d}  {entry['recommended_by']}")
    print(f"wrote {args.out}" + (f" and {args.runs}" if args.runs else "") + f" in {wall:.1f} s")
    return 0

