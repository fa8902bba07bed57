"""What the hop between a split instance's stages costs through the product: the invoker's instance manager
(process backend, two GPUs from an inventory file, a real Redis for the budgets) runs one two-stage instance,
and each activation's first stage hands the second `--sizes` MiB: a tensor (`pipeline.send` of a uint8 array,
`pipeline.receive` on the other side), or a JSON string. Requests of each size alternate with requests handing
on nothing, so the machine's noise hits all alike; what a hand-off adds is the difference of their medians, and
the hop is what is left of it once the stages' own work (building and reading what they hand on) is taken out.

A tensor goes two ways, alternating in one run: `frames`, as the product hands it on (a stage frame on the direct
lane: its bytes as they are, never base64, never JSON, never parsed by the invoker), and `json`, as it went before
stage frames (base64 in the JSON of the result and of the next run's body, parsed and encoded again by the
invoker; the bench sends the runs without their stage flag to get it). A string is JSON either way.

    PYTHONPATH=. python3 bench/split_hop.py [--sizes 0.25,1,4,16] [--requests 15] [--payloads tensor,string]
                                            [--no-direct-lane] [--json FILE] [--out FILE]

The process backend hands each run to the stage's worker on its direct lane (docs/runtime.md, "The direct
lane"), not through the runtime's HTTP proxy: this is the path a split instance's activations take on an
invoker with the process backend. `--no-direct-lane` sends them through the runtimes' HTTP endpoints instead, the
Docker backend's path (stage frames as HTTP bodies where the runtime takes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dilu_invoker import config
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.instances import InstanceManager
from dilu_invoker.invoker.dataplane import runtime_client
from dilu_invoker.invoker.dataplane.core import open_invoker
from dilu_invoker.logs import configure
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActionLimits,
    ActivationRequest,
    ActivationStatus,
    Exec,
    Parameter,
    new_activation_id,
)
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.wire import InstanceCommand, InstanceState, StageRecord, stage_id

PREFIX = "hop:"
UUIDS = ("GPU-hop-0", "GPU-hop-1")
#: stage 0 hands on `pad` bytes, as a uint8 tensor (`kind` "tensor") or a string (as base64 would be); stage 1
#: answers how many it got; each says how long its own work took, so that the hop is what is left
CODE = '''
import os, time
import numpy as np
from dilu_invoker.actions import pipeline

def main(args):
    t = time.perf_counter()
    k = int(os.environ["DILU_STAGE_INDEX"])
    if k == 0:
        pad = int(args.get("pad", 0))
        if args.get("kind") == "tensor":
            out = pipeline.send(np.full(pad, 7, dtype=np.uint8), kind="tensor")
        else:
            out = {"pad": "A" * pad, "kind": "string"}
        return {**out, "ms0": 1000 * (time.perf_counter() - t)}
    if args.get("kind") == "tensor":
        x, meta = pipeline.receive(args, as_numpy=True)
        got = int(x.size)
    else:
        got = len(args.get("pad", ""))
    return {"got": got, "ms0": args.get("ms0", 0.0), "ms1": 1000 * (time.perf_counter() - t)}
'''

#: whether the bench lets a stage's run go as a stage frame (off: the `json` mode, the path before stage frames)
FRAMES = {"on": True}
_client_run = runtime_client.RuntimeClient.run


async def _run_switched(self: Any, payload: Any, timeout_s: float, *, stage: bool | None = None) -> Any:
    return await _client_run(self, payload, timeout_s, stage=stage if FRAMES["on"] else None)


runtime_client.RuntimeClient.run = _run_switched  # type: ignore[method-assign]


def _action() -> Action:
    return Action(namespace="guest", name="hop", exec=Exec(kind="python:3-gpu", code=CODE),
                  limits=replace(ActionLimits(), timeout_ms=120_000, memory_mb=1024), revision="1-hop",
                  annotations=(Parameter("gpu-class", "llm"), Parameter("gpu-stages", 2),
                               Parameter("gpu-sm-request", 0.2), Parameter("gpu-sm-limit", 0.5),
                               Parameter("gpu-memory-mb", 8000)))


#: (payload, mode) pairs each size is measured in, in the order they alternate
MODES = {"tensor": ("frames", "json"), "string": ("json",)}


async def measure(sizes_mib: list[float], requests: int, scratch: Path,
                  payloads: tuple[str, ...] = ("tensor", "string"), direct_lane: bool = True) -> dict[str, Any]:
    server = EmbeddedRedis(scratch / "redis")
    await server.start()
    redis = redis_client(server.url)
    inventory = scratch / "inventory.json"
    inventory.write_text(json.dumps([{"uuid": u, "memory_mb": 16000} for u in UUIDS]))
    base = config.load(environ={})
    configure(replace(base.log, level="warning"))  # the invoker's debug lines would be timed too
    cfg = replace(base, data_dir=str(scratch / "data"), redis=replace(base.redis, prefix=PREFIX),
                  gpu=replace(base.gpu, inventory=str(inventory), mps="off"),
                  invoker=replace(base.invoker, user_memory_mb=8192, preload=0, model_preload_mb=0,
                                  process_direct_lane=direct_lane))
    rows: list[dict[str, Any]] = []
    try:
        async with open_invoker(cfg, redis=redis) as invoker:
            agent = Agent.of(invoker, redis, prefix=PREFIX, boot="hop")
            manager = InstanceManager(agent, reservation_ttl_s=600.0)
            action = _action()
            await agent.registry.ensure(action)
            stages = tuple(StageRecord(id=stage_id("hop-1", k), gpu=k, gpu_uuid=UUIDS[k], request=0.2, limit=0.5,
                                       memory_mb=4000) for k in range(2))
            manager.handle(InstanceCommand(op="start", epoch=1, instance="hop-1", function=action.fqn,
                                           rev=action.revision or "", gpu=0, gpu_uuid=UUIDS[0], request=0.4,
                                           limit=1.0, memory_mb=8000, stages=stages))
            deadline = time.monotonic() + 60
            while manager.instances["hop-1"].state is not InstanceState.READY:
                inst = manager.instances["hop-1"]
                if inst.failure is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the split instance did not start: {inst.failure}")
                await asyncio.sleep(0.05)

            async def run(pad: int, kind: str = "string", frames: bool = True) -> tuple[float, float]:
                FRAMES["on"] = frames
                req = ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                                        content={"pad": pad, "kind": kind})
                t = time.perf_counter()
                activation = await manager.run("hop-1", req)
                ms = 1000 * (time.perf_counter() - t)
                if activation is None or activation.response.status is not ActivationStatus.SUCCESS:
                    raise SystemExit(f"a run failed: {activation.response.result if activation else None}")
                result = activation.response.result
                assert isinstance(result, dict) and result["got"] == pad
                return ms, float(result["ms0"]) + float(result["ms1"])

            for _ in range(3):  # warm-up
                await run(0)
                await run(1, "tensor")
            modes = [(payload, mode) for payload in payloads for mode in MODES[payload]]
            for mib in sizes_mib:
                pad = int(mib * (1 << 20))
                empty: list[float] = []
                full: dict[tuple[str, str], list[float]] = {m: [] for m in modes}
                inside: dict[tuple[str, str], list[float]] = {m: [] for m in modes}
                for _ in range(requests):
                    empty.append((await run(0))[0])
                    for payload, mode in modes:
                        ms, work = await run(pad, payload, mode == "frames")
                        full[payload, mode].append(ms)
                        inside[payload, mode].append(work)
                e = statistics.median(empty)
                for payload, mode in modes:
                    f, w = statistics.median(full[payload, mode]), statistics.median(inside[payload, mode])
                    hop = f - e - w
                    rows.append({"payload": payload, "mode": mode, "mib": mib, "bytes": pad, "empty_ms": e,
                                 "with_ms": f, "stages_work_ms": w, "hop_ms": hop,
                                 "hop_ms_per_mib": hop / mib if mib else None, "empty_all": empty,
                                 "with_all": full[payload, mode]})
                    print(f"{mib:g} MiB {payload} ({mode}): empty {e:.1f} ms, with the hand-off {f:.1f} ms, the stages' "
                          f"own work {w:.1f} ms, hop {hop:.1f} ms ({hop / mib:.1f} ms/MiB)", flush=True)
            await manager.close()
    finally:
        await redis.aclose()
        await server.stop()
    return {"rows": rows, "direct_lane": direct_lane}


def render(raw: dict[str, Any]) -> str:
    path = "the direct lane" if raw.get("direct_lane", True) else "the runtimes' HTTP endpoints (no direct lane)"
    lines = [
        "# The hop between a split instance's stages, through the invoker (bench/split_hop.py)",
        "",
        (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "",
        f"* machine: {raw['machine']}",
        f"* path: {path}",
        f"* command: `{raw['command']}`",
        f"* time: {raw['utc']}",
        "",
        "| hand-off MiB | payload | how | p50 without (ms) | p50 with (ms) | the stages' own work (ms) | the hop (ms) "
        "| ms per MiB |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in raw["rows"]:
        per = f"{r['hop_ms_per_mib']:.1f}" if r["hop_ms_per_mib"] is not None else "—"
        lines.append(f"| {r['mib']:g} | {r['payload']} | {r['mode']} | {r['empty_ms']:.1f} | {r['with_ms']:.1f} | "
                     f"{r['stages_work_ms']:.1f} | {r['hop_ms']:.1f} | {per} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1,4,16", help="MiB handed from stage 0 to stage 1, comma separated")
    ap.add_argument("--requests", type=int, default=15, help="requests of each size (and as many without)")
    ap.add_argument("--payloads", default="tensor,string", help="what stage 0 hands on: tensor, string (comma separated)")
    ap.add_argument("--no-direct-lane", action="store_true",
                    help="runs go through the runtimes' HTTP endpoints (the Docker backend's path), not the direct lane")
    ap.add_argument("--json", help="the raw results")
    ap.add_argument("--out", help="the Markdown report")
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes.split(",") if x]
    payloads = tuple(x for x in args.payloads.split(",") if x)
    if not sizes or any(s <= 0 or s > 48 for s in sizes) or args.requests < 1:
        raise SystemExit("--sizes: MiB in (0, 48] (an intermediate result may weigh 64 MiB); --requests >= 1")
    if not payloads or any(p not in MODES for p in payloads):
        raise SystemExit(f"--payloads: some of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="dilu-hop-") as tmp:
        raw = asyncio.run(measure(sizes, args.requests, Path(tmp), payloads, not args.no_direct_lane))
    raw.update({"utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
                "command": "PYTHONPATH=. python3 " + " ".join(["bench/split_hop.py", *sys.argv[1:]]),
                "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, Python "
                           f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}"})
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.out:
        Path(args.out).write_text(render(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
