"""A GPU tenant for the manager's end-to-end tests: launches "kernels" through the fake libcuda (under the
shim when LD_PRELOAD says so), in a pattern set by commands on stdin:

    run <blocks> <gap_us>                              launch continuously (a training loop)
    load <blocks> <gap_us> <bytes>                     a launch and a device allocation of <bytes> per step (a
                                                       model being loaded and moved to the GPU)
    burst <blocks> <launches> <gap_us> <pause_ms> [sync]
                                                       bursts of launches, then a pause (inference requests);
                                                       with sync, each burst ends in cuCtxSynchronize (one
                                                       request span)
    requests <blocks> <launches> <pause_ms>            launches back to back, cuCtxSynchronize, a pause (requests
                                                       as PyTorch serves them: enqueue, then wait for the GPU)
    idle                                               launch nothing
    quit

It answers ``ok <command>`` on stdout once the command is in force.

``--contend STATS --contend-capacity C``: while bursting, each launch takes longer the faster the tenant
whose stats block is STATS is admitted (gap × (1 + 2 × its rate / C)). The fake driver's timeline is per
process, so this stands in for two processes sharing one GPU: the other tenant's work stretches this
one's kernel-launch cycles, which is what the vertical policy feeds back on.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dilu_invoker.gpu import abi


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contend", type=Path)
    ap.add_argument("--contend-capacity", type=float, default=1.0)
    args = ap.parse_args()

    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch.restype = ctypes.c_int
    synchronize = cuda.cuCtxSynchronize
    synchronize.argtypes = []
    synchronize.restype = ctypes.c_int
    mem_alloc = cuda.cuMemAlloc_v2
    mem_alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    mem_alloc.restype = ctypes.c_int
    if cuda.cuInit(0) != 0:
        print("cuInit failed", flush=True)
        return 1

    other = abi.StatsFile.open(args.contend) if args.contend else None
    mode: list[object] = ["idle"]
    lock = threading.Lock()
    stop = threading.Event()

    def stretch() -> float:
        if other is None:
            return 1.0
        s = other.snapshot()
        if not s.window_ns:
            return 1.0
        rate = s.window_blocks_last / (s.window_ns / 1e6)
        return 1.0 + 2.0 * rate / args.contend_capacity

    def one(blocks: int) -> None:
        if launch(None, blocks, 1, 1, 1, 1, 1, 0, 0x100, None, None) != 0:
            raise SystemExit("cuLaunchKernel failed")

    def worker() -> None:
        while not stop.is_set():
            with lock:
                current = mode[0]
            if current == "idle":
                time.sleep(0.002)
            elif current[0] == "requests":  # type: ignore[index]
                _, blocks, launches, pause_ms = current  # type: ignore[misc]
                for _ in range(launches):
                    one(blocks)
                if synchronize() != 0:
                    raise SystemExit("cuCtxSynchronize failed")
                time.sleep(pause_ms / 1000)
            elif current[0] == "load":  # type: ignore[index]
                _, blocks, gap_us, size = current  # type: ignore[misc]
                one(blocks)
                ptr = ctypes.c_uint64()
                if mem_alloc(ctypes.byref(ptr), size) != 0:
                    raise SystemExit("cuMemAlloc_v2 failed")
                time.sleep(gap_us / 1e6)
            elif current[0] == "run":  # type: ignore[index]
                _, blocks, gap_us = current  # type: ignore[misc]
                one(blocks)
                time.sleep(gap_us / 1e6)
            else:
                _, blocks, launches, gap_us, pause_ms, sync = current  # type: ignore[misc]
                for _ in range(launches):
                    one(blocks)
                    time.sleep(gap_us * stretch() / 1e6)
                if sync and synchronize() != 0:
                    raise SystemExit("cuCtxSynchronize failed")
                time.sleep(pause_ms / 1000)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd = words[0]
        with lock:
            if cmd == "run":
                mode[0] = ("run", int(words[1]), float(words[2]))
            elif cmd == "load":
                mode[0] = ("load", int(words[1]), float(words[2]), int(words[3]))
            elif cmd == "burst":
                mode[0] = ("burst", int(words[1]), int(words[2]), float(words[3]), float(words[4]),
                           words[5:] == ["sync"])
            elif cmd == "requests":
                mode[0] = ("requests", int(words[1]), int(words[2]), float(words[3]))
            elif cmd == "idle":
                mode[0] = "idle"
            elif cmd == "quit":
                break
            else:
                print(f"unknown {cmd}", flush=True)
                continue
        print(f"ok {cmd}", flush=True)
    stop.set()
    t.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
