"""What the hop between a split instance's stages costs through the product: the invoker's instance manager
(process backend, two GPUs from an inventory file, a real Redis for the budgets) runs one two-stage instance,
and each activation's first stage hands the second an intermediate result of `--sizes` MiB (a JSON string), the
way `dilu_invoker.actions.pipeline.send` hands on a tensor (base64 in JSON). Requests of each size alternate
with requests handing on nothing, so the machine's noise hits both alike; the hop's cost is the difference of
their medians (what the stages themselves do, building and measuring the string, is reported apart).

    PYTHONPATH=. python3 bench/split_hop.py [--sizes 0.25,1,4,16] [--requests 15] [--json FILE] [--out FILE]

The process backend hands each run to the stage's worker on its direct lane (docs/runtime.md, "The direct
lane"), not through the runtime's HTTP proxy: this is the path a split instance's activations take on an
invoker, where `bench/split_pipeline.py` measures the runtimes' HTTP endpoints (the Docker backend's path).
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
#: stage 0 hands on `pad` bytes (a string, as base64 would be), stage 1 answers how many it got; each says how
#: long its own work took, so that the hop is what is left
CODE = '''
import os, time

def main(args):
    t = time.perf_counter()
    k = int(os.environ["DILU_STAGE_INDEX"])
    if k == 0:
        pad = "A" * int(args.get("pad", 0))
        return {"pad": pad, "ms0": 1000 * (time.perf_counter() - t)}
    return {"got": len(args.get("pad", "")), "ms0": args.get("ms0", 0.0), "ms1": 1000 * (time.perf_counter() - t)}
'''


def _action() -> Action:
    return Action(namespace="guest", name="hop", exec=Exec(kind="python:3-gpu", code=CODE),
                  limits=replace(ActionLimits(), timeout_ms=120_000, memory_mb=1024), revision="1-hop",
                  annotations=(Parameter("gpu-class", "llm"), Parameter("gpu-stages", 2),
                               Parameter("gpu-sm-request", 0.2), Parameter("gpu-sm-limit", 0.5),
                               Parameter("gpu-memory-mb", 8000)))


async def measure(sizes_mib: list[float], requests: int, scratch: Path) -> dict[str, Any]:
    server = EmbeddedRedis(scratch / "redis")
    await server.start()
    redis = redis_client(server.url)
    inventory = scratch / "inventory.json"
    inventory.write_text(json.dumps([{"uuid": u, "memory_mb": 16000} for u in UUIDS]))
    base = config.load(environ={})
    configure(replace(base.log, level="warning"))  # the invoker's debug lines would be timed too
    cfg = replace(base, data_dir=str(scratch / "data"), redis=replace(base.redis, prefix=PREFIX),
                  gpu=replace(base.gpu, inventory=str(inventory), mps="off"),
                  invoker=replace(base.invoker, user_memory_mb=8192, preload=0, model_preload_mb=0))
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

            async def run(pad: int) -> tuple[float, float]:
                req = ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                                        content={"pad": pad})
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
            for mib in sizes_mib:
                pad = int(mib * (1 << 20))
                empty: list[float] = []
                full: list[float] = []
                inside: list[float] = []
                for _ in range(requests):
                    empty.append((await run(0))[0])
                    ms, work = await run(pad)
                    full.append(ms)
                    inside.append(work)
                e, f, w = statistics.median(empty), statistics.median(full), statistics.median(inside)
                hop = f - e - w
                rows.append({"mib": mib, "bytes": pad, "empty_ms": e, "with_ms": f, "stages_work_ms": w, "hop_ms": hop,
                             "hop_ms_per_mib": hop / mib if mib else None, "empty_all": empty, "with_all": full})
                print(f"{mib:g} MiB: empty {e:.1f} ms, with the hand-off {f:.1f} ms, the stages' own work {w:.1f} ms, "
                      f"hop {hop:.1f} ms ({hop / mib:.1f} ms/MiB)", flush=True)
            await manager.close()
    finally:
        await redis.aclose()
        await server.stop()
    return {"rows": rows}


def render(raw: dict[str, Any]) -> str:
    lines = [
        "# The hop between a split instance's stages, through the invoker (bench/split_hop.py)",
        "",
        (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "",
        f"* machine: {raw['machine']}",
        f"* command: `{raw['command']}`",
        f"* time: {raw['utc']}",
        "",
        "| hand-off MiB | p50 without (ms) | p50 with (ms) | the stages' own work (ms) | the hop (ms) | ms per MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in raw["rows"]:
        per = f"{r['hop_ms_per_mib']:.1f}" if r["hop_ms_per_mib"] is not None else "—"
        lines.append(f"| {r['mib']:g} | {r['empty_ms']:.1f} | {r['with_ms']:.1f} | {r['stages_work_ms']:.1f} | "
                     f"{r['hop_ms']:.1f} | {per} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1,4,16", help="MiB handed from stage 0 to stage 1, comma separated")
    ap.add_argument("--requests", type=int, default=15, help="requests of each size (and as many without)")
    ap.add_argument("--json", help="the raw results")
    ap.add_argument("--out", help="the Markdown report")
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes.split(",") if x]
    if not sizes or any(s <= 0 or s > 48 for s in sizes) or args.requests < 1:
        raise SystemExit("--sizes: MiB in (0, 48] (an intermediate result may weigh 64 MiB); --requests >= 1")
    with tempfile.TemporaryDirectory(prefix="dilu-hop-") as tmp:
        raw = asyncio.run(measure(sizes, args.requests, Path(tmp)))
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
