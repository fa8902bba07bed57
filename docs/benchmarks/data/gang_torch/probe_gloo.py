"""Diagnosis only: does torch.distributed's gloo rendezvous work between two plain processes here?
(run2_probe_gloo.log; run from the repository root on the GPU machine.)"""
import os
import socket
import subprocess
import sys

CODE = """
import os, torch, torch.distributed as dist
dist.init_process_group(backend="gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
print("rank", dist.get_rank(), "sum", x.item(), flush=True)
"""
host = socket.gethostname()
print("hostname", host)
try:
    print("getaddrinfo", sorted({a[4][0] for a in socket.getaddrinfo(host, None)}))
except OSError as exc:
    print("getaddrinfo failed", exc)
for extra in ({}, {"GLOO_SOCKET_IFNAME": "lo"}):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, "-c", CODE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), **extra}) for r in (0, 1)]
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        print(f"--- {extra} rank {r} rc={p.returncode}\n{out[-3000:]}")
