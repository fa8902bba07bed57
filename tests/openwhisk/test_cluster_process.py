"""``dilu-invoker invoker`` as a real child process: the invoker core with the process backend behind the
Kafka/CouchDB front, configured through the environment names OpenWhisk's invoker reads."""

from __future__ import annotations

import asyncio
import base64
import importlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ow_cluster.harness import (
    ControllerHarness,
    check_ack,
    check_activation,
    check_ping,
)
from ow_cluster.peers import PouchServer, TansuBroker, free_port
from ow_cluster.support import get_activation, invoker_env, put_action

from dilu_invoker.openwhisk.couchdb import ACTION_REMOVED

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "operator", "s3cret-enough"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


needs_core = pytest.mark.skipif(not _importable("dilu_invoker.invoker.dataplane.core"),
                                reason="the invoker core cannot be imported in this checkout")


class Child:
    def __init__(self, broker: TansuBroker, pouch: PouchServer, workdir: Path, *, invoker_id: int) -> None:
        self.invoker_id = invoker_id
        self.port = free_port()
        self.env = {**os.environ, **invoker_env(broker, pouch), "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true",
                    "PORT": str(self.port), "CONFIG_whisk_invoker_username": USER,
                    "CONFIG_whisk_invoker_password": PASSWORD, "DILU_INVOKER_BACKEND": "process",
                    "DILU_DATA_DIR": str(workdir), "CONFIG_whisk_invoker_dedicated_namespaces": "['team-a']"}
        self.log = workdir / f"invoker{invoker_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "invoker", "--id", str(self.invoker_id)],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.log.parent)

    async def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.proc.wait, 60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def http(self, method: str, path: str, *, auth: bool = True) -> tuple[int, str]:
        def call() -> tuple[int, str]:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=b"" if method == "POST" else None)
            if auth:
                token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                req.add_header("Authorization", f"Basic {token}")
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        return await asyncio.to_thread(call)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.couchdb
@needs_core
@pytest.mark.asyncio(loop_scope="module")
async def test_invoker_process_health_control_shutdown_and_resume(
    broker: TansuBroker, pouch: PouchServer, tmp_path: Path
) -> None:
    child = Child(broker, pouch, tmp_path, invoker_id=21)
    async with ControllerHarness(broker.bootstrap, invoker=21) as harness:
        child.start()
        try:
            ping = await harness.wait_ping(lambda p: p["name"]["instance"] == 21 and p["isEnabled"], timeout=60)
            check_ping(ping, instance=21)
            assert ping["name"]["dedicatedNamespaces"] == ["team-a"]
            assert ping["name"]["userMemory"] == f"{1024 * 1024 * 1024} B"
            assert await child.http("GET", "/ping", auth=False) == (200, "pong")

            health = harness.message("activation_health_test_captured.json")
            missing = harness.message(path="guest", name="not-there", revision="1-x", blocking=True)
            await harness.publish(health)
            last = await harness.publish(missing)
            for msg in (health, missing):
                for ack in await harness.wait_completion(msg["activationId"], timeout=30):
                    check_ack(ack, sent_transid=msg["transid"], instance=21)
            (combined,) = harness.acks[missing["activationId"]]
            assert combined.activation is not None
            assert combined.activation["response"]["result"] == {"error": ACTION_REMOVED}
            assert combined.obj["isSystemError"] is False

            # /disable: one ping with isEnabled=false, then silence; /enable: pings again.
            assert (await child.http("POST", "/invoker/disable"))[0] == 200
            await harness.wait_ping(lambda p: p["name"]["instance"] == 21 and not p["isEnabled"])
            assert await child.http("GET", "/isEnabled") == (200, '{"enabled": false}')
            assert (await child.http("POST", "/invoker/enable"))[0] == 200
            enabled_again = asyncio.get_running_loop().time()
            await harness.wait_ping(lambda p: p["name"]["instance"] == 21 and p["isEnabled"], after=enabled_again)
            assert (await child.http("POST", "/invoker/disable", auth=False))[0] == 401

            stopping = asyncio.get_running_loop().time()
            assert await child.stop() == 0, child.tail()
            await harness.wait_ping(lambda p: p["name"]["instance"] == 21 and not p["isEnabled"], after=stopping)
            assert await harness.committed("invoker21") == last + 1

            # Sent while the invoker is down: taken from the committed offset after the restart.
            later = harness.message("activation_health_test_captured.json")
            await harness.publish(later)
            child.start()
            acks = await harness.wait_completion(later["activationId"], timeout=60)
            assert [a.kind for a in acks] == ["completion"]
            assert await child.stop() == 0, child.tail()
        finally:
            child.kill()
        # Nothing before the committed offset was answered again.
        assert [a.kind for a in harness.acks[health["activationId"]]] == ["completion"]
        assert [a.kind for a in harness.acks[missing["activationId"]]] == ["combined"]


PYTHON_ACTION = """
def main(args):
    print("hello from the action")
    return {"greeting": "hello " + args.get("name", "?")}
"""


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.couchdb
@needs_core
@pytest.mark.skipif(not _importable("dilu_invoker.actions.runtime"),
                    reason="the action runtime (dilu_invoker.actions.runtime) is not in this checkout")
@pytest.mark.asyncio(loop_scope="module")
async def test_invoker_process_runs_a_python_action_from_couchdb(
    broker: TansuBroker, pouch: PouchServer, tmp_path: Path
) -> None:
    child = Child(broker, pouch, tmp_path, invoker_id=22)
    rev = put_action(pouch, namespace="guest", name="greeter", kind="python:3.11", code=PYTHON_ACTION)
    async with ControllerHarness(broker.bootstrap, invoker=22) as harness:
        child.start()
        try:
            await harness.wait_ping(lambda p: p["name"]["instance"] == 22 and p["isEnabled"], timeout=60)
            msg = harness.message(path="guest", name="greeter", revision=rev, blocking=True)
            await harness.publish(msg)
            acks = await harness.wait_completion(msg["activationId"], timeout=60)
            assert [a.kind for a in acks] == ["result", "completion"], child.tail()
            for ack in acks:
                check_ack(ack, sent_transid=msg["transid"], instance=22)
            result = acks[0].activation
            assert result is not None and result["response"]["result"] == {"greeting": "hello world"}, child.tail()
            assert await child.stop() == 0, child.tail()
        finally:
            child.kill()
    record = get_activation(pouch, "guest", msg["activationId"])
    assert record is not None
    check_activation(record)
    assert any("hello from the action" in line for line in record["logs"])


def test_cli_refuses_a_configuration_without_kafka(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CONFIG_whisk", "DILU_"))}
    env.update(PYTHONPATH=str(ROOT), RUNTIMES_MANIFEST='{"runtimes": {}}', CONFIG_whisk_couchdb_host="127.0.0.1")
    done = subprocess.run([sys.executable, "-m", "dilu_invoker", "invoker", "--id", "0"], env=env, cwd=tmp_path,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert b"KAFKA_HOSTS" in done.stderr
