"""What a live stage move costs through the product: `dilu-invoker standalone` (process backend, three 16 GB GPUs from
an inventory file, its embedded Redis and balancer, compaction every 0.5 s) serves an llm action declaring
gpu-stages 2 over its REST API while compaction moves its stage 0 to another GPU.

The scenario: a filler that scales to zero when idle and a second filler light GPUs 0 and 1; the llm (9 GB) is split
over them; a small function (SM request 0.6, so its GPU is no compaction source) lights GPU 2. Once the first filler
has scaled to zero, GPU 0 holds stage 0 alone and compaction moves it to GPU 2 while `--clients` clients keep
invoking the llm (blocking, each request right after the last). Each trial reports every request's latency and
outcome, which process and GPU ran stage 0, when the balancer ordered the move and when it was done, and the
compaction totals (cold starts paid). `tests/loadbalancer/test_stage_moves.py` runs one trial and checks it.

    PYTHONPATH=. python3 bench/stage_move.py [--trials 5] [--clients 2] [--json FILE] [--out FILE]

The stages run trivial Python on the CPU: this measures the control plane's hand-over (the new stage's cold start
beside the old one, the switch, the drain), not a model's load time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.logs import configure
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import run_standalone
from dilu_invoker.wire import Decision, InstanceRecord, Keys, decode, from_stream

GPU_MB = 16000
#: each stage notes its index, its GPU and its process; the client checks the request's own number comes back
CODE = """
import os

def main(args):
    seen = list(args.get("seen", []))
    seen.append([int(os.environ["DILU_STAGE_INDEX"]), os.environ.get("DILU_GPU_UUID", ""), os.getpid()])
    return {"seen": seen, "n": args["n"]}
"""
FILLER = "def main(a):\n    return a\n"


@dataclass
class Trial:
    """What one trial saw (times in seconds on the client's monotonic clock unless said otherwise)."""

    before: InstanceRecord
    after: InstanceRecord
    #: (client, request number, start, latency s, the stages' [index, GPU uuid, pid] lists)
    results: list[tuple[int, int, float, float, list[list[Any]]]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    #: the balancer's `stage-move` and `stage-move-done` decisions' times (its clock: wall seconds)
    ordered_at: float = 0.0
    done_at: float = 0.0
    #: wall clock minus the client's monotonic clock, to put the decisions on the requests' time line
    wall_offset: float = 0.0
    totals: dict[str, int] = field(default_factory=dict)
    #: reservations left on the GPU stage 0 left
    left_behind: dict[str, Any] = field(default_factory=dict)
    source_gpu: int = 0

    def summary(self) -> dict[str, Any]:
        t0, t1 = self.ordered_at - self.wall_offset, self.done_at - self.wall_offset
        during = [lat for _, _, start, lat, _ in self.results if t0 <= start <= t1 or t0 <= start + lat <= t1]
        outside = [lat for _, _, start, lat, _ in self.results if start + lat < t0 or start > t1]
        return {
            "requests": len(self.results) + len(self.failures), "failed": len(self.failures),
            "move_s": round(self.done_at - self.ordered_at, 3),
            "p50_ms_outside": round(1000 * statistics.median(outside), 2) if outside else None,
            "max_ms_outside": round(1000 * max(outside), 2) if outside else None,
            "p50_ms_during": round(1000 * statistics.median(during), 2) if during else None,
            "max_ms_during": round(1000 * max(during), 2) if during else None,
            "requests_during": len(during),
            "cold_starts": self.totals.get("started", 0), "moves_done": self.totals.get("done", 0),
            "moves_abandoned": self.totals.get("abandoned", 0),
            "stage0_gpus": sorted({seen[0][1] for *_, seen in self.results}),
            "left_behind": sorted(self.left_behind),
        }


def inventory_standalone(workdir: Path, uuids: list[str], **balancer: Any) -> config.Config:
    """`standalone`'s embedded defaults with the GPUs `uuids` (16 GB each) from an inventory file in `workdir`, its
    data there, the API on a free port, and the balancer's settings `balancer` over quick ticks and reports."""
    (workdir / "inventory.json").write_text(json.dumps([{"uuid": u, "memory_mb": GPU_MB} for u in uuids]))
    base = config.load(environ={})
    return replace(base, data_dir=str(workdir / "data"), api=replace(base.api, port=0),
                   gpu=replace(base.gpu, inventory=str(workdir / "inventory.json")),
                   balancer=replace(base.balancer, **{"tick_s": 0.2, "report_period_s": 0.2, "report_ttl_s": 1.0,
                                                      **balancer}))


#: the guest's credentials, as `wsk` sends them
GUEST_AUTH = {"Authorization": f"Basic {base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()}"}


async def stage_move_trial(workdir: Path, *, clients: int = 1, after: int = 5, timeout_s: float = 30.0) -> Trial:
    """One trial in `workdir` (see the module doc): the clients run until `after` requests each ended after the
    move was done."""
    cfg = inventory_standalone(workdir, [f"GPU-m{g}" for g in range(3)], compaction_period_s=0.5,
                               scale_to_zero_after_s=2.0, cooldown_s=0.2)
    async with run_standalone(cfg) as running, aiohttp.ClientSession(headers=GUEST_AUTH) as http:
        assert running.balancer is not None
        redis = running.balancer.redis
        keys = Keys(cfg.redis.prefix)
        url = f"{running.api_url}/api/v1/namespaces/_/actions"

        async def create(name: str, code: str, ann: dict[str, object], **limits: int) -> None:
            body = {"exec": {"kind": "python:3-gpu", "code": code}, "limits": limits,
                    "annotations": [{"key": k, "value": v} for k, v in ann.items()]}
            async with http.put(f"{url}/{name}", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"PUT {name}: {r.status} {await r.text()}")
            async with http.post(f"{url}/{name}?blocking=true", json={"n": 0}) as r:  # registers the function
                if r.status != 200:
                    raise RuntimeError(f"POST {name}: {r.status} {await r.text()}")

        async def records(function: str, n: int) -> list[InstanceRecord]:
            deadline = time.monotonic() + timeout_s
            while True:
                got = [r for r in (decode(InstanceRecord, raw) for raw in (await redis.hgetall(keys.instances)).values())
                       if r is not None and r.function == function]
                if len(got) == n and all(r.state == "ready" and not r.moving for r in got):
                    return got
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{function}: never {n} settled instances: {got}")
                await asyncio.sleep(0.05)

        await create("fill0", FILLER, {"gpu-memory-mb": 10000, "gpu-sm-request": 0.3, "gpu-sm-limit": 0.5})
        [fill0] = await records("guest/fill0", 1)
        await create("fill1", FILLER, {"gpu-memory-mb": 10000, "gpu-sm-request": 0.3, "gpu-sm-limit": 0.5,
                                       "min-instances": 1})
        await records("guest/fill1", 1)
        await create("llm", CODE, {"gpu-class": "llm", "gpu-stages": 2, "gpu-memory-mb": 9000, "gpu-sm-request": 0.4,
                                   "gpu-sm-limit": 0.6, "min-instances": 1, "max-instances": 1}, concurrency=4)
        [llm] = await records("guest/llm", 1)
        await create("small", FILLER, {"gpu-memory-mb": 3500, "gpu-sm-request": 0.6, "gpu-sm-limit": 0.7,
                                       "min-instances": 1})
        await records("guest/small", 1)
        trial = Trial(before=llm, after=llm, source_gpu=fill0.gpu or 0,
                      wall_offset=time.time() - time.monotonic())
        moved = asyncio.Event()
        ended_after: list[int] = [0] * clients

        async def client(c: int) -> None:
            n = 0
            while ended_after[c] < after:
                n += 1
                start = time.monotonic()
                try:
                    async with http.post(f"{url}/llm?blocking=true&result=true", json={"n": n}) as r:
                        body = await r.json()
                        ok = r.status == 200 and body.get("n") == n
                except (aiohttp.ClientError, ValueError) as exc:
                    ok, body = False, repr(exc)
                lat = time.monotonic() - start
                if ok:
                    trial.results.append((c, n, start, lat, body["seen"]))
                else:
                    trial.failures.append(f"client {c} request {n}: {body}")
                if moved.is_set():
                    ended_after[c] += 1

        tasks = [asyncio.create_task(client(c)) for c in range(clients)]
        try:
            await records("guest/fill0", 0)  # scaled to zero: stage 0 is alone on its GPU
            deadline = time.monotonic() + timeout_s
            while True:
                [now] = await records("guest/llm", 1)
                if now.stages[0].id != llm.stages[0].id:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stage 0 never moved: {now}")
                await asyncio.sleep(0.05)
            trial.after = now
            moved.set()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        finally:
            for t in tasks:
                t.cancel()
        for _, f in await redis.xrange(keys.decisions) or ():
            d = from_stream(Decision, f or {})
            if d.kind == "stage-move":
                trial.ordered_at = d.at
            elif d.kind == "stage-move-done":
                trial.done_at = d.at
        trial.totals = dict(running.balancer.metrics.totals)
        left = await GpuBudgets(redis, cfg.redis.prefix).get(f"GPU-m{trial.source_gpu}")
        trial.left_behind = dict(left.reservations) if left is not None else {}
        return trial


def render(raw: dict[str, Any]) -> str:
    rows = raw["trials"]
    lines = [
        "# A live stage move through the product",
        "",
        f"* machine: {raw['machine']}",
        f"* date: {raw['date']}",
        f"* command: `{raw['command']}`",
        "",
        "`dilu-invoker standalone` (process backend, three inventory GPUs, embedded Redis and balancer) serves an llm",
        "declaring gpu-stages 2 while compaction moves its stage 0 to another GPU (bench/stage_move.py's doc). Each",
        f"trial: {raw['clients']} client(s) invoking it back to back over the REST API. Times: the balancer's",
        "`stage-move` decision to its `stage-move-done` (`move s`); request latency outside that window and in it.",
        "The stages run trivial Python on the CPU: this is the control plane's hand-over, not a model's load.",
        "",
        "| trial | requests | failed | move s | p50 ms outside | max ms outside | p50 ms during | max ms during | "
        "requests during | cold starts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(rows, 1):
        lines.append(f"| {k} | {r['requests']} | {r['failed']} | {r['move_s']} | {r['p50_ms_outside']} | "
                     f"{r['max_ms_outside']} | {r['p50_ms_during']} | {r['max_ms_during']} | {r['requests_during']} | "
                     f"{r['cold_starts']} |")

    def med_worst(key: str, worst: Any = max) -> str:
        vals = [r[key] for r in rows if r[key] is not None]
        return f"{statistics.median(vals):g} / {worst(vals):g}" if vals else "n/a"

    lines += [
        "",
        f"Median / worst over {len(rows)} trials: move {med_worst('move_s')} s; p50 latency outside the move "
        f"{med_worst('p50_ms_outside')} ms, during it {med_worst('p50_ms_during')} ms; the slowest request during a "
        f"move {med_worst('max_ms_during')} ms; failed requests {sum(r['failed'] for r in rows)} in all.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--after", type=int, default=20, help="requests each client makes once the move is done")
    ap.add_argument("--json", help="the raw results")
    ap.add_argument("--out", help="the Markdown report")
    args = ap.parse_args()
    base = config.load(environ={})
    configure(replace(base.log, level="warning"))
    trials = []
    for k in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="stage-move-") as scratch:
            trial = asyncio.run(stage_move_trial(Path(scratch), clients=args.clients, after=args.after))
        s = trial.summary()
        trials.append(s)
        print(f"trial {k + 1}: {json.dumps(s)}", flush=True)
    raw = {
        "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "PYTHONPATH=. python3 bench/stage_move.py " + " ".join(sys.argv[1:]),
        "clients": args.clients, "trials": trials,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.out:
        Path(args.out).write_text(render(raw))
    print(render(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
