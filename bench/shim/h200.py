#!/usr/bin/env python3
"""Steps of the shim's H200 benchmark (issue 3 (a)-(e)); run by bench/shim/run_h200.sh.

    python3 bench/shim/h200.py step <name> --work DIR --results DIR --log FILE
    python3 bench/shim/h200.py merge --results DIR --out FILE [--machine FILE] [--command STR]

Each step writes results/<name>.json, also when it fails (with "error"), so one broken
step never loses the others. Stdlib only; the shim's ABI helpers are loaded by path.

Overrides (for a dry run of this pipeline without a GPU):
DILU_BENCH_GPU_BENCH (gpu_bench binary), DILU_BENCH_PYTHON (python with torch),
DILU_BENCH_MPS_CONTROL (nvidia-cuda-mps-control), DILU_BENCH_SCALE (shorten runs, 0..1].
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "cuda_shim" / "build"


def _load_abi() -> Any:
    spec = importlib.util.spec_from_file_location(
        "dilu_shim_abi", REPO / "dilu_invoker" / "gpu" / "abi.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


abi = _load_abi()
SCALE = min(1.0, max(0.01, float(os.environ.get("DILU_BENCH_SCALE", "1"))))

# Kernels: (b)/(e) use 528 blocks (4 per SM of an H200) of ~0.27 ms; (c) uses 132-block
# kernels of a few tens of microseconds so that 2 ms bins hold several completions.
ACC_BLOCKS, ACC_ITERS = 528, 8192
REACT_BLOCKS, REACT_ITERS = 132, 4096
SHARE_PAIRS = ((0.1, 0.9), (0.3, 0.7), (0.5, 0.5))
SOLO_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)


class Bench:
    def __init__(self, work: Path, log_path: Path, cpu: str | None) -> None:
        self.work = work
        self.log_path = log_path
        self.cpu = pick_cpu(cpu) if shutil.which("taskset") else None
        if self.cpu is not None and not taskset_works(self.cpu):
            self.cpu = (
                None  # e.g. a sandbox that refuses sched_setaffinity: run unpinned
            )
        self.gpu_bench = os.environ.get("DILU_BENCH_GPU_BENCH", str(work / "gpu_bench"))
        self.python = os.environ.get("DILU_BENCH_PYTHON", sys.executable)
        self.lib = BUILD / "libdilu_shim.so"
        self.n = 0

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def base_env(self) -> dict[str, str]:
        drop = ("DILU_SHIM_", "CUDA_MPS_", "LD_PRELOAD")
        return {k: v for k, v in os.environ.items() if not k.startswith(drop)}

    def env_for(
        self, variant: str, quota: Any = None
    ) -> tuple[dict[str, str], Path | None]:
        """native | passthrough | limited (finite rate that never binds) | quota (the given Quota)."""
        env = self.base_env()
        if variant == "native":
            return env, None
        env["LD_PRELOAD"] = str(self.lib)
        if variant == "passthrough":
            return env, None
        if variant == "limited":
            quota = abi.Quota(rate_blocks_per_ms=1e9, burst_blocks=1 << 62)
        assert quota is not None, variant
        # Nobody heartbeats during a benchmark: never stale.
        quota = dataclasses.replace(quota, stale_after_ns=0)
        self.n += 1
        ctl, st = abi.create_instance_files(
            self.work / "instances", f"i{self.n}", quota
        )
        ctl.close()
        st.close()
        env["DILU_SHIM_CONTROL"] = str(ctl.path)
        env["DILU_SHIM_STATS"] = str(st.path)
        return env, st.path

    def _cmd(self, cmd: list[str], pin: bool) -> list[str]:
        return ["taskset", "-c", self.cpu, *cmd] if pin and self.cpu else cmd

    def run(
        self, cmd: list[str], env: dict[str, str], timeout: float, *, pin: bool = False
    ) -> dict[str, Any]:
        cmd = self._cmd(cmd, pin)
        self.log(
            "run: "
            + " ".join(cmd)
            + f"  (LD_PRELOAD={'yes' if 'LD_PRELOAD' in env else 'no'})"
        )
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                cmd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = (
                124,
                _text(e.stdout),
                _text(e.stderr) + f"\n(timeout after {timeout} s)",
            )
        dt = time.monotonic() - t0
        self.log(
            f"  rc={rc} in {dt:.1f} s"
            + ("" if rc == 0 else "; stderr tail: " + _tail(err))
        )
        return {"rc": rc, "stdout": out, "stderr": err, "seconds": dt}

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        self.log(
            "start: "
            + " ".join(cmd)
            + f"  (LD_PRELOAD={'yes' if 'LD_PRELOAD' in env else 'no'})"
        )
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def finish(self, p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        try:
            out, err = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            rc = 124
        self.log(
            f"  pid {p.pid} rc={rc}"
            + ("" if rc == 0 else "; stderr tail: " + _tail(err))
        )
        return {"rc": rc, "stdout": out, "stderr": err}

    def stats(self, path: Path | None) -> dict[str, Any] | None:
        if path is None:
            return None
        try:
            with abi.StatsFile.open(path) as st:
                snap = st.snapshot()
        except (
            OSError,
            ValueError,
            RuntimeError,
        ) as e:  # a broken stats file is a finding
            return {"error": repr(e)}
        d = dataclasses.asdict(snap)
        d["flags"] = int(snap.flags)
        d["flag_names"] = [f.name for f in abi.StatsFlag if f in snap.flags]
        d["recent_cycles"] = list(snap.recent_cycles)
        return d

    def gpu(self, *args: str) -> list[str]:
        return [self.gpu_bench, *args]


def pick_cpu(want: str | None) -> str | None:
    """The CPU to pin latency runs to: the one asked for if we may run there, else our highest."""
    allowed = sorted(os.sched_getaffinity(0))
    if not allowed:
        return None
    if want is not None and want.isdigit() and int(want) in allowed:
        return want
    return str(allowed[-1])


def taskset_works(cpu: str) -> bool:
    try:
        r = subprocess.run(
            ["taskset", "-c", cpu, "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _text(x: Any) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _tail(s: str, n: int = 6) -> str:
    return " | ".join(s.strip().splitlines()[-n:])


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def summary(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"runs": [], "min": None, "median": None}
    return {"runs": vals, "min": min(vals), "median": statistics.median(vals)}


def secs(x: float) -> float:
    return max(1.0, round(x * SCALE, 2))


# ======================================================================================
# steps
# ======================================================================================


def step_c_tests(b: Bench, out: dict[str, Any]) -> None:
    r = b.run(["make", "-C", str(REPO / "cuda_shim"), "test"], b.base_env(), 300)
    out.update(
        rc=r["rc"],
        ok=r["rc"] == 0,
        output_tail=(r["stdout"] + r["stderr"]).strip().splitlines()[-30:],
    )


def step_fastpath(b: Bench, out: dict[str, Any]) -> None:
    """Shim cost per launch against the fake driver: no GPU noise."""
    exe = str(BUILD / "tests" / "fastpath_bench")
    runs: dict[str, list[float]] = {"native": [], "passthrough": [], "limited": []}
    for _ in range(3):
        for variant, results in runs.items():
            env = b.base_env()
            env["LD_LIBRARY_PATH"] = str(BUILD / "fake")
            args = [exe, variant]
            if variant != "native":
                env["LD_PRELOAD"] = str(b.lib)
            if variant == "limited":
                args.append("--limited")
            r = b.run(args, env, 120, pin=True)
            j = last_json(r["stdout"])
            if j:
                results.append(j["ns_per_call_min"])
    s = {k: summary(v) for k, v in runs.items()}
    nat = s["native"]["median"]
    over = {
        k: (
            s[k]["median"] - nat
            if s[k]["median"] is not None and nat is not None
            else None
        )
        for k in ("passthrough", "limited")
    }
    out.update(ns_per_call=s, overhead_ns=over, pinned_cpu=b.cpu)


def step_enqueue(b: Bench, out: dict[str, Any]) -> None:
    """(a) host enqueue time of empty kernels, native vs pass-through vs limited-not-blocking, interleaved."""
    batches = str(max(200, int(1500 * SCALE)))
    out["pinned_cpu"] = b.cpu
    for grid, rounds in (("1", 5), ("1056", 2)):
        per: dict[str, list[dict[str, Any]]] = {
            "native": [],
            "passthrough": [],
            "limited": [],
        }
        stats: list[Any] = []
        out[f"raw_grid_{grid}"] = (
            per  # filled as runs finish: kept if the step is cut short
        )
        for _ in range(rounds):
            for variant, results in per.items():
                env, st = b.env_for(variant)
                r = b.run(
                    b.gpu("enqueue", "--grid", grid, "--batches", batches),
                    env,
                    120,
                    pin=True,
                )
                j = last_json(r["stdout"])
                if j:
                    results.append(j)
                if st:
                    stats.append(b.stats(st))
        res: dict[str, Any] = {}
        for variant, js in per.items():
            res[variant] = {
                "enqueue_us_p50": summary([j["enqueue_us_p50"] for j in js]),
                "enqueue_us_p90": summary([j["enqueue_us_p90"] for j in js]),
                "launch_sync_us_p50": summary([j["launch_sync_us_p50"] for j in js]),
            }
        for variant in ("passthrough", "limited"):
            a, n = res[variant]["enqueue_us_p50"], res["native"]["enqueue_us_p50"]
            res[variant]["overhead_us_min"] = (
                a["min"] - n["min"]
                if a["min"] is not None and n["min"] is not None
                else None
            )
            res[variant]["overhead_us_median"] = (
                a["median"] - n["median"]
                if a["median"] is not None and n["median"] is not None
                else None
            )
        res["limited_stats"] = stats[-1] if stats else None
        out[f"grid_{grid}"] = res


def burn_args(blocks: int, iters: int, seconds: float, *extra: str) -> list[str]:
    return [
        "burn",
        "--blocks",
        str(blocks),
        "--iters",
        str(iters),
        "--seconds",
        f"{seconds:.2f}",
        *extra,
    ]


def solo(
    b: Bench,
    variant: str,
    blocks: int,
    iters: int,
    seconds: float,
    quota: Any = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    env, st = b.env_for(variant, quota)
    r = b.run(b.gpu(*burn_args(blocks, iters, seconds, *extra)), env, seconds + 90)
    j = last_json(r["stdout"]) or {"rc": r["rc"]}
    j["stats"] = b.stats(st)
    return j


def pair(
    b: Bench,
    envs: Sequence[tuple[dict[str, str], Path | None]],
    blocks: int,
    iters: int,
    seconds: float,
    skip_ms: float,
) -> list[dict[str, Any]]:
    start_at = time.monotonic_ns() + 2_500_000_000  # both CUDA contexts are up by then
    procs = [
        b.start(
            b.gpu(
                *burn_args(
                    blocks,
                    iters,
                    seconds,
                    "--start-at",
                    str(start_at),
                    "--skip-ms",
                    str(skip_ms),
                )
            ),
            env,
        )
        for env, _ in envs
    ]
    results = []
    for p, (_, st) in zip(procs, envs, strict=True):
        r = b.finish(p, seconds + 120)
        j = last_json(r["stdout"]) or {"rc": r["rc"], "stderr": _tail(r["stderr"])}
        j["stats"] = b.stats(st)
        results.append(j)
    return results


def step_accuracy(b: Bench, out: dict[str, Any]) -> None:
    """(b) two processes at target shares of the solo block rate R0."""
    out["kernel"] = {"blocks": ACC_BLOCKS, "iters": ACC_ITERS, "threads_per_block": 256}
    cal = solo(b, "native", ACC_BLOCKS, ACC_ITERS, secs(3))
    r0 = cal.get("blocks_per_ms")
    out["calibration_native"] = cal
    if not r0:
        out["error"] = "calibration failed"
        return
    out["r0_blocks_per_ms"] = r0
    pt = solo(b, "passthrough", ACC_BLOCKS, ACC_ITERS, secs(3))
    out["solo_passthrough_share"] = pt.get("blocks_per_ms", 0) / r0
    out["solo_limited"] = []
    for share in SOLO_SHARES:
        j = solo(
            b,
            "quota",
            ACC_BLOCKS,
            ACC_ITERS,
            secs(2.5),
            abi.Quota(
                rate_blocks_per_ms=share * r0, share=share, capacity_blocks_per_ms=r0
            ),
        )
        got = j.get("blocks_per_ms", 0) / r0
        out["solo_limited"].append(
            {
                "target": share,
                "achieved": got,
                "error_pp": 100 * (got - share),
                "stats": j.get("stats"),
            }
        )
    seconds, skip = secs(4), 700.0 * SCALE
    base = pair(
        b,
        [b.env_for("native"), b.env_for("native")],
        ACC_BLOCKS,
        ACC_ITERS,
        seconds,
        skip,
    )
    out["pair_unlimited"] = [j.get("blocks_per_ms", 0) / r0 for j in base]
    out["pairs"] = []
    for sa, sb in SHARE_PAIRS:
        envs = [
            b.env_for(
                "quota",
                abi.Quota(
                    rate_blocks_per_ms=s * r0, share=s, capacity_blocks_per_ms=r0
                ),
            )
            for s in (sa, sb)
        ]
        res = pair(b, envs, ACC_BLOCKS, ACC_ITERS, seconds, skip)
        achieved = [j.get("blocks_per_ms", 0) / r0 for j in res]
        out["pairs"].append(
            {
                "targets": [sa, sb],
                "achieved": achieved,
                "error_pp": [
                    100 * (g - t) for g, t in zip(achieved, (sa, sb), strict=True)
                ],
                "raw": res,
            }
        )
    errs = [abs(e) for p in out["pairs"] for e in p["error_pp"]]
    out["max_abs_error_pp"] = max(errs) if errs else None


def reaction_times(
    bins: list[float], bin_ms: float, flip_ms: float, window_ms: float = 4.0
) -> dict[str, Any]:
    """Time from a control write to 50% and 90% of the way to the new steady rate.

    Rates are trailing averages over window_ms; the old steady rate is the mean over
    the 500 ms before the write, the new one the mean from 300 to 800 ms after it.
    """
    rate = [x / bin_ms for x in bins]  # blocks per ms in each bin

    def mean(t0: float, t1: float) -> float:
        i0, i1 = max(0, int(t0 / bin_ms)), min(len(rate), int(t1 / bin_ms))
        return statistics.fmean(rate[i0:i1]) if i1 > i0 else 0.0

    old, new = mean(flip_ms - 600, flip_ms - 100), mean(flip_ms + 300, flip_ms + 800)
    delta = new - old
    w = max(1, round(window_ms / bin_ms))
    found: dict[str, float | None] = {"t50_ms": None, "t90_ms": None}
    for i in range(int(flip_ms / bin_ms) + 1, len(rate)):
        t_end = (i + 1) * bin_ms
        avg = statistics.fmean(rate[max(0, i + 1 - w) : i + 1])
        moved = (avg - old) / delta if delta else 0.0
        for key, frac in (("t50_ms", 0.5), ("t90_ms", 0.9)):
            if found[key] is None and moved >= frac:
                found[key] = t_end - flip_ms
        if found["t90_ms"] is not None:
            break
    return {"old_blocks_per_ms": old, "new_blocks_per_ms": new, **found}


def step_reaction(b: Bench, out: dict[str, Any]) -> None:
    """(c) a share change 20% -> 80% -> 20% written into the control block of a running process."""
    out["kernel"] = {"blocks": REACT_BLOCKS, "iters": REACT_ITERS}
    cal = solo(b, "native", REACT_BLOCKS, REACT_ITERS, secs(2))
    r0 = cal.get("blocks_per_ms")
    out["calibration_native"] = cal
    if not r0:
        out["error"] = "calibration failed"
        return
    out["r0_blocks_per_ms"] = r0
    low, high = 0.2 * r0, 0.8 * r0
    out["runs"] = []
    for _ in range(2):
        quota = abi.Quota(rate_blocks_per_ms=low, share=0.2, capacity_blocks_per_ms=r0)
        env, st = b.env_for("quota", quota)
        ctl_path = env["DILU_SHIM_CONTROL"]
        args = burn_args(
            REACT_BLOCKS,
            REACT_ITERS,
            3.0,
            "--skip-ms",
            "0",
            "--bin-ms",
            "2",
            "--control",
            ctl_path,
            "--flip",
            f"1000:{high}",
            "--flip",
            f"2000:{low}",
        )
        r = b.run(b.gpu(*args), env, 120)
        j = last_json(r["stdout"])
        if not j or "bins_blocks" not in j:
            out["runs"].append({"rc": r["rc"], "error": "no bins"})
            continue
        flips = j.get("flips", [])
        analysed = [
            reaction_times(j["bins_blocks"], j["bin_ms"], f["at_ms"])
            | {"to_rate": f["rate"]}
            for f in flips
        ]
        out["runs"].append(
            {
                "flips": analysed,
                "bins_blocks": j["bins_blocks"],
                "bin_ms": j["bin_ms"],
                "target_low": low,
                "target_high": high,
                "stats": b.stats(st),
            }
        )
    t90 = [f["t90_ms"] for run in out["runs"] for f in run.get("flips", [])]
    out["max_t90_ms"] = max(t90) if t90 and None not in t90 else None


def step_resnet(b: Bench, out: dict[str, Any]) -> None:
    """(d) torchvision ResNet-50 inference latency, batch 1 and 32, interleaved variants."""
    script = str(REPO / "bench" / "shim" / "resnet_bench.py")
    iters = [str(max(30, int(300 * SCALE))), str(max(10, int(60 * SCALE)))]
    per: dict[str, list[dict[str, Any]]] = {
        "native": [],
        "passthrough": [],
        "limited": [],
    }
    out["runs"] = per
    for rnd in range(2):
        for variant, results in per.items():
            env, st = b.env_for(variant)
            cmd = [b.python, script, "--batches", "1", "32", "--iters", *iters]
            if variant == "limited" and rnd == 0:
                cmd.append("--graph-check")
            r = b.run(cmd, env, 240)
            j = last_json(r["stdout"])
            if j:
                results.append(j)
            if st:
                out["limited_stats"] = b.stats(st)
    for batch in ("1", "32"):
        res: dict[str, Any] = {}
        for variant, js in per.items():
            res[variant] = summary(
                [
                    j["batches"][batch]["p50_ms"]
                    for j in js
                    if batch in j.get("batches", {})
                ]
            )
        for variant in ("passthrough", "limited"):
            a, n = res[variant]["median"], res["native"]["median"]
            res[variant]["overhead_pct"] = (
                100 * (a - n) / n if a is not None and n else None
            )
        out[f"batch_{batch}"] = res


def step_mps(b: Bench, out: dict[str, Any]) -> None:
    """(e) the same share pairs through MPS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE."""
    ctl = os.environ.get("DILU_BENCH_MPS_CONTROL", "nvidia-cuda-mps-control")
    if not shutil.which(ctl):
        out["error"] = f"{ctl} not found"
        return
    pipe, logd = b.work / "mps_pipe", b.work / "mps_log"
    pipe.mkdir(exist_ok=True)
    logd.mkdir(exist_ok=True)
    menv = b.base_env() | {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(logd),
    }
    acc = b.work / "results" / "accuracy.json"
    r0_native = None
    if acc.exists():
        r0_native = json.loads(acc.read_text()).get("r0_blocks_per_ms")
    out["r0_native_blocks_per_ms"] = r0_native
    started = b.run([ctl, "-d"], menv, 30)
    out["daemon_rc"] = started["rc"]
    try:
        if started["rc"] != 0:
            out["error"] = "MPS daemon did not start"
            return
        time.sleep(1)
        cal_env = dict(menv)
        r = b.run(b.gpu(*burn_args(ACC_BLOCKS, ACC_ITERS, secs(3))), cal_env, 120)
        cal = last_json(r["stdout"]) or {}
        r0_mps = cal.get("blocks_per_ms")
        out["r0_mps_blocks_per_ms"] = r0_mps
        r0 = r0_native or r0_mps
        if not r0:
            out["error"] = "calibration under MPS failed"
            return
        out["pairs"] = []
        seconds, skip = secs(4), 700.0 * SCALE
        for sa, sb in SHARE_PAIRS:
            envs = [
                (
                    menv | {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(round(s * 100))},
                    None,
                )
                for s in (sa, sb)
            ]
            res = pair(b, envs, ACC_BLOCKS, ACC_ITERS, seconds, skip)
            got = [j.get("blocks_per_ms", 0) / r0 for j in res]
            out["pairs"].append(
                {
                    "targets": [sa, sb],
                    "achieved": got,
                    "error_pp": [
                        100 * (g - s) for g, s in zip(got, (sa, sb), strict=True)
                    ],
                    "raw": res,
                }
            )
        errs = [abs(e) for p in out["pairs"] for e in p["error_pp"]]
        out["max_abs_error_pp"] = max(errs) if errs else None
    finally:
        q = subprocess.run(
            [ctl],
            input="quit\n",
            env=menv,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        b.log(f"MPS quit rc={q.returncode}")
        out["quit_rc"] = q.returncode
        time.sleep(2)


def step_threads64(b: Bench, out: dict[str, Any]) -> None:
    """64 threads launching through a limited bucket on their own streams: no hang."""
    threads, launches = 64, max(50, int(500 * SCALE))
    env, st = b.env_for(
        "quota", abi.Quota(rate_blocks_per_ms=3000.0, burst_blocks=3000)
    )
    r = b.run(
        b.gpu(
            "threads",
            "--threads",
            str(threads),
            "--launches",
            str(launches),
            "--grid",
            "4",
        ),
        env,
        120,
    )
    j = last_json(r["stdout"]) or {}
    s = b.stats(st)
    want = threads * launches
    ok = (
        r["rc"] == 0
        and s is not None
        and s.get("launches", 0) >= want
        and j.get("errors") == 0
    )
    out.update(rc=r["rc"], result=j, stats=s, expected_launches=want, ok=ok)


def step_memcap(b: Bench, out: dict[str, Any]) -> None:
    """Memory cap exact to the byte through cudart on the real driver."""
    cap = 1 << 30
    env, st = b.env_for("quota", abi.Quota(mem_cap_bytes=cap))
    r = b.run(b.gpu("memcap"), env, 120)
    j = last_json(r["stdout"]) or {}
    s = b.stats(st)
    checks = {
        "total_is_cap": j.get("total0") == cap,
        "rest_allocates": j.get("alloc_rest") == 0,
        "nothing_left": j.get("free_after_rest") == 0,
        "one_more_byte_refused": j.get("alloc_one_more")
        == 2,  # cudaErrorMemoryAllocation
        "free_restores": j.get("free_after_free") == j.get("free_before_rest"),
        "async_rest_allocates": j.get("async_rest") == 0,
        "async_one_more_refused": j.get("async_one_more") == 2,
    }
    out.update(
        rc=r["rc"],
        cap=cap,
        result=j,
        checks=checks,
        ok=r["rc"] == 0 and all(checks.values()),
        stats=s,
    )


STEPS: dict[str, Callable[[Bench, dict[str, Any]], None]] = {
    "c_tests": step_c_tests,
    "fastpath": step_fastpath,
    "enqueue": step_enqueue,
    "accuracy": step_accuracy,
    "reaction": step_reaction,
    "resnet": step_resnet,
    "mps": step_mps,
    "threads64": step_threads64,
    "memcap": step_memcap,
}


def cmd_step(args: argparse.Namespace) -> int:
    work, results = Path(args.work), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    b = Bench(work, Path(args.log), args.cpu)
    b.log(f"step {args.name} begins")
    t0 = time.monotonic()
    res: dict[str, Any] = {}

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"killed by signal {signum} (step time limit)")

    # `timeout` sends SIGTERM: keep what was measured so far
    signal.signal(signal.SIGTERM, on_term)
    try:
        STEPS[args.name](b, res)
    except BaseException as e:  # noqa: BLE001 - the step's result must be written whatever happened
        res["error"] = str(e) if isinstance(e, SystemExit) else traceback.format_exc()
        b.log(f"step {args.name} stopped: {res['error']}")
    res["step_seconds"] = round(time.monotonic() - t0, 1)
    (results / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=str))
    b.log(f"step {args.name} done in {res['step_seconds']} s")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    results = Path(args.results)
    steps: dict[str, Any] = {}
    for name in [*STEPS, "build"]:
        p = results / f"{name}.json"
        if p.exists():
            try:
                steps[name] = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                steps[name] = {"error": f"unreadable result: {e}"}
        else:
            steps[name] = {"error": "step did not run or was killed (see shim_log.txt)"}
    machine = (
        Path(args.machine).read_text()
        if args.machine and Path(args.machine).exists()
        else ""
    )
    doc = {
        "schema": 1,
        # stand-ins replaced the GPU programs (bench/shim/dry_run.sh): nothing here is a measurement
        "dry_run": bool(os.environ.get("DILU_BENCH_GPU_BENCH")),
        "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": args.command,
        "scale": SCALE,
        "machine": machine,
        "steps": steps,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("name", choices=sorted(STEPS))
    s.add_argument("--work", required=True)
    s.add_argument("--results", required=True)
    s.add_argument("--log", required=True)
    s.add_argument("--cpu", default="3")
    m = sub.add_parser("merge")
    m.add_argument("--results", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--machine")
    m.add_argument("--command", default="bench/shim/run_h200.sh")
    args = ap.parse_args()
    return cmd_step(args) if args.cmd == "step" else cmd_merge(args)


if __name__ == "__main__":
    sys.exit(main())
