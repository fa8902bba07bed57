"""Record the shim's stats block of real models on a GPU, phase by phase, as test data for the capacity
estimator (tests/gpu/test_capacity_traces.py), and smoke-test the invoker's MPS module on the machine.

    python3 bench/gpu_traces.py traces --out DIR [--models resnet50,bert] [--seconds 4]
    python3 bench/gpu_traces.py mps --out DIR

``traces``: for each model a child process runs under the shim (unlimited quota) through loading (build,
``.to("cuda")``), warm-up (first requests), serving (closed loop, batch 8 fp16), paced requests at about
half its closed-loop rate, and idle; the parent snapshots the stats block every 50 ms. Output:
``DIR/trace_<model>.json`` with the phases (CLOCK_MONOTONIC ns) and every snapshot.

``mps``: starts an MPS daemon through ``dilu_invoker.gpu.mps`` (mode auto), runs two clients at 50% active
threads, kills one with SIGKILL (does the other go on?), kills the control daemon (does the supervisor
restart it; do the clients go on?), stops it; prints and writes ``DIR/mps_smoke.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dilu_invoker.gpu import abi, shim

# -- the child: a model through its phases -----------------------------------------------------------------


def phase(name: str) -> None:
    print(f"phase {name} {time.monotonic_ns()}", flush=True)


def child(model_name: str, seconds: float) -> None:
    phase("import")
    if model_name == "dry":  # the harness without torch (CPU machines)
        for name in ("build", "load", "warmup", "serve", "paced", "idle", "done"):
            phase(name)
            time.sleep(0.2)
        print("serve_median_ms 1.0", flush=True)
        return
    import torch

    phase("build")
    batch = 8
    if model_name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).eval().half()
        make = lambda: torch.randn(batch, 3, 224, 224, dtype=torch.half, device="cuda")  # noqa: E731
    else:
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig()).eval().half()
        make = lambda: torch.randint(0, 30000, (batch, 128), device="cuda")  # noqa: E731
    phase("load")
    model = model.to("cuda")
    torch.cuda.synchronize()

    def request() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            x = make()
            out = model(x)
            if not isinstance(out, torch.Tensor):
                out = out.last_hidden_state
            out.float().sum().item()
        return time.perf_counter() - t

    phase("warmup")
    for _ in range(3):
        request()
    phase("serve")
    end = time.monotonic() + seconds
    times = []
    while time.monotonic() < end:
        times.append(request())
    per = sorted(times)[len(times) // 2]
    phase("paced")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = request()
        time.sleep(max(0.0, 2 * per - t))
    phase("idle")
    time.sleep(1.0)
    phase("done")
    print(f"serve_median_ms {per * 1000:.3f}", flush=True)


# -- the parent: snapshots -----------------------------------------------------------------------------


def snap_dict(s: abi.StatsSnapshot) -> dict:
    d = dataclasses.asdict(s)
    d["flags"] = int(s.flags)
    return d


def record(model_name: str, seconds: float, out: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix="dilu-trace-"))
    quota = abi.Quota(rate_blocks_per_ms=0.0, share=1.0, capacity_blocks_per_ms=0.0, mem_cap_bytes=0,
                      stale_after_ns=0)
    control, stats = abi.create_instance_files(root, model_name, quota)
    files = abi.instance_files(root, model_name)
    env = shim.process_env(control_path=files.control, stats_path=files.stats, base_env=dict(os.environ))
    proc = subprocess.Popen([sys.executable, __file__, "child", "--model", model_name, "--seconds", str(seconds)],
                            env=env, stdout=subprocess.PIPE, text=True)
    phases: list[tuple[str, int]] = []
    snaps: list[dict] = []
    extra: dict[str, float] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            w = line.split()
            if len(w) == 3 and w[0] == "phase":
                phases.append((w[1], int(w[2])))
            elif len(w) == 2:
                extra[w[0]] = float(w[1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        control.heartbeat()
        try:
            s = stats.snapshot(attempts=2000)
            snaps.append({"t_ns": time.monotonic_ns(), **snap_dict(s)})
        except abi.StatsBusyError:
            pass
        time.sleep(0.05)
    reader.join(timeout=5)
    doc = {"model": model_name, "seconds": seconds, "rc": proc.returncode, "phases": phases, "extra": extra,
           "period_s": 0.05, "snapshots": snaps}
    (out / f"trace_{model_name}.json").write_text(json.dumps(doc))
    print(f"{model_name}: rc {proc.returncode}, {len(snaps)} snapshots, phases {[p for p, _ in phases]}, {extra}")
    return doc


# -- MPS smoke test -------------------------------------------------------------------------------------

CLIENT = """
import sys, time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
n, t0 = 0, time.monotonic()
while True:
    (a @ a).sum().item(); n += 1
    if n % 20 == 0:
        print(n, round(time.monotonic() - t0, 3), flush=True)
"""


async def mps_smoke(out: Path) -> dict:
    from dilu_invoker.gpu.devices import compute_mode, discover_nvml
    from dilu_invoker.gpu.mps import MpsMode, MpsSupervisor

    found = discover_nvml().devices
    gpus = tuple((d.index, d.uuid) for d in found)
    result: dict = {"gpus": [dataclasses.asdict(d) for d in found]}
    sup = MpsSupervisor(mode=MpsMode.AUTO, root=Path(tempfile.mkdtemp(prefix="dilu-mps-")), gpus=gpus,
                        compute_mode=compute_mode, check_every_s=3600)
    await sup.start()
    result["decisions"] = {i: dataclasses.asdict(d) for i, d in sup.decisions.items()}
    if not sup.enabled(0):
        return result
    cfg = sup.client(0, 0.5, backend="process")
    assert cfg is not None
    env = {**os.environ, **cfg.env, "CUDA_VISIBLE_DEVICES": "0"}
    result["client_env"] = dict(cfg.env)
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]

    counts = [0, 0]

    def follow(i: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.split():
                counts[i] = int(line.split()[0])

    for i, p in enumerate(procs):
        threading.Thread(target=follow, args=(i, p), daemon=True).start()

    def last_count(p: subprocess.Popen, wait_s: float) -> int:
        time.sleep(wait_s)
        return counts[procs.index(p)]

    daemon = sup.daemons[0]
    result["counts_before"] = [last_count(p, 6.0) for p in procs]
    rc, servers = await daemon._control(stdin="get_server_list\n")
    result["server_list"] = [rc, servers]
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    a0 = last_count(procs[0], 0.1)
    a1 = last_count(procs[0], 3.0)
    result["client_crash"] = {"survivor_before": a0, "survivor_after_3s": a1, "survivor_alive": procs[0].poll() is None}
    # Kill the control daemon (not the server): does the supervisor start it again, does the client go on?
    ps = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control -d"], capture_output=True, text=True)
    pids = [int(x) for x in ps.stdout.split()]
    result["control_pids"] = pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.5)
    b0 = last_count(procs[0], 0.1)
    result["after_control_kill"] = {"alive": await daemon.alive()}
    await sup.check_once()
    result["after_check"] = {"alive": await daemon.alive(), "restarts": daemon.restarts}
    b1 = last_count(procs[0], 3.0)
    result["survivor_through_control_kill"] = {"before": b0, "after_3s": b1, "alive": procs[0].poll() is None}
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    await sup.stop()
    result["after_stop_alive"] = await daemon.alive()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("child")
    c.add_argument("--model", required=True)
    c.add_argument("--seconds", type=float, default=4.0)
    t = sub.add_parser("traces")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--models", default="resnet50,bert")
    t.add_argument("--seconds", type=float, default=4.0)
    m = sub.add_parser("mps")
    m.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "child":
        child(args.model, args.seconds)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "traces":
        for name in args.models.split(","):
            record(name, args.seconds, args.out)
        return 0
    result = asyncio.run(mps_smoke(args.out))
    (args.out / "mps_smoke.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
