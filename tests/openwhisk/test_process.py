"""``dilu-invoker invoker`` as a real child process: configuration from OpenWhisk's environment names,
SIGTERM drains and commits, a restart resumes from the committed offset."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import invoker_env, put_action
from .harness import ControllerHarness, check_ack, check_ping
from .peers import PouchServer, TansuBroker

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("invoker_child.py")
INVOKER_ID = 21


def start_child(broker: TansuBroker, pouch: PouchServer, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **invoker_env(broker, pouch), "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true",
           "CONFIG_whisk_invoker_dedicated_namespaces": "['team-a']"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(CHILD), "--id", str(INVOKER_ID)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


async def stop_child(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(proc.wait, 40)


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.couchdb
@pytest.mark.asyncio(loop_scope="module")
async def test_child_process_serves_stops_cleanly_and_resumes(
    broker: TansuBroker, pouch: PouchServer, tmp_path: Path
) -> None:
    rev = put_action(pouch, namespace="guest", name="child-echo", code="echo")
    log = tmp_path / "invoker.log"
    async with ControllerHarness(broker.bootstrap, invoker=INVOKER_ID) as harness:
        proc = start_child(broker, pouch, log)
        try:
            ping = await harness.wait_ping(lambda p: p["name"]["instance"] == INVOKER_ID and p["isEnabled"],
                                           timeout=30)
            check_ping(ping, instance=INVOKER_ID)
            assert ping["name"]["dedicatedNamespaces"] == ["team-a"]
            health = harness.message("activation_health_test_captured.json")
            user = harness.message(path="guest", name="child-echo", revision=rev, blocking=True)
            await harness.publish(health)
            last = await harness.publish(user)
            for msg in (health, user):
                for ack in await harness.wait_completion(msg["activationId"], timeout=30):
                    check_ack(ack, sent_transid=msg["transid"], instance=INVOKER_ID)
            stopping = asyncio.get_running_loop().time()
            assert await stop_child(proc) == 0
            await harness.wait_ping(lambda p: p["name"]["instance"] == INVOKER_ID and not p["isEnabled"],
                                    after=stopping)
            assert await harness.committed(f"invoker{INVOKER_ID}") == last + 1

            # Sent while the invoker is down: taken from the committed offset after the restart.
            later = harness.message(path="guest", name="child-echo", revision=rev, blocking=False)
            await harness.publish(later)
            proc = start_child(broker, pouch, log)
            acks = await harness.wait_completion(later["activationId"], timeout=30)
            assert [a.kind for a in acks] == ["completion"]
            assert await stop_child(proc) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # Nothing before the committed offset ran again.
        assert [a.kind for a in harness.acks[user["activationId"]]] == ["result", "completion"]
        assert [a.kind for a in harness.acks[health["activationId"]]] == ["completion"]


def test_cli_refuses_a_configuration_without_kafka(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CONFIG_whisk", "DILU_"))}
    env.update(PYTHONPATH=str(ROOT), RUNTIMES_MANIFEST='{"runtimes": {}}', CONFIG_whisk_couchdb_host="127.0.0.1")
    done = subprocess.run([sys.executable, "-m", "dilu_invoker", "invoker", "--id", "0"], env=env, cwd=tmp_path,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert b"KAFKA_HOSTS" in done.stderr
