"""The runtime image built from a local root filesystem (no registry) serves actions under podman.

Builds with dilu_invoker/actions/images/build_local.sh: about 35 s the first time (debootstrap from the
Debian mirror), a few seconds when the root filesystem tarball is cached in $DILU_IMAGE_CACHE.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator

import aiohttp
import pytest

from dilu_invoker.invoker.dataplane.runtime_client import (
    ActivationContext,
    ActivationLogReader,
    ActivationStatus,
    RuntimeClient,
    build_init_body,
    build_run_body,
)
from tests.fakes.runtime_process import REPO_ROOT, free_port

pytestmark = [
    pytest.mark.podman,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("podman") is None or shutil.which("debootstrap") is None or os.geteuid() != 0,
        reason="needs root, podman and debootstrap",
    ),
]

BUILD = REPO_ROOT / "dilu_invoker" / "actions" / "images" / "build_local.sh"
# Works without /etc/containers/containers.conf (reference/environment.md §2).
RUN_FLAGS = ["--runtime", "runc", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


@pytest.fixture
def images(runtime_images: list[str]) -> list[str]:
    return runtime_images


async def podman(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "podman", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def test_build_tags_every_manifest_image(images: list[str]) -> None:
    manifest = json.loads((REPO_ROOT / "dilu_invoker" / "actions" / "runtimes.json").read_text())
    expected = [
        f"{m['image']['prefix']}/{m['image']['name']}:{m['image']['tag']}"
        for members in manifest["runtimes"].values()
        for m in members
    ]
    assert images == expected


async def test_image_runs_actions_and_stops_cleanly(http: aiohttp.ClientSession, images: list[str]) -> None:
    port = free_port()
    name = f"dilu-runtime-test-{port}"
    await podman("run", "-d", "--name", name, *RUN_FLAGS, "-p", f"127.0.0.1:{port}:8080", images[0])
    try:
        client = RuntimeClient(http, f"http://127.0.0.1:{port}")
        source = (
            "import sys, aiohttp\n\n"
            "def main(args):\n"
            "    print('hello from the image')\n"
            "    return {'python': list(sys.version_info[:2]), 'aiohttp': aiohttp.__version__, 'got': args}\n"
        )
        init = await client.init(build_init_body(name="probe", code=source, binary=False), 60)
        assert init.ok, init.result
        ctx = ActivationContext(
            namespace="guest",
            action_name="/guest/probe",
            action_version="0.0.1",
            activation_id="img1",
            transaction_id="t",
            deadline_ms=2**41,
        )
        outcome = await client.run(build_run_body({"x": 1}, ctx), 60)
        assert outcome.status_code is ActivationStatus.SUCCESS
        assert outcome.result["python"] == [3, 11]
        assert outcome.result["aiohttp"].startswith("3.8.")
        assert outcome.result["got"] == {"x": 1}

        # podman's log stream, split at the sentinels like the docker backend will do it.
        logs_process = await asyncio.create_subprocess_exec(
            "podman", "logs", name, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        assert logs_process.stdout is not None and logs_process.stderr is not None
        reader = ActivationLogReader(logs_process.stdout, logs_process.stderr)
        logs = await reader.collect(limit_bytes=1 << 20, timeout_s=30)
        await logs_process.wait()
        assert logs.complete
        assert [line.split(" ", 1)[1].strip() for line in logs.lines] == ["stdout: hello from the image"]

        # SIGTERM reaches the runtime as PID 1 and it exits by itself (not killed after the timeout).
        await podman("stop", "-t", "20", name)
        assert await podman("inspect", "--format", "{{.State.ExitCode}}", name) == "0"
    finally:
        await podman("rm", "-f", name)
