"""Faults under load, with real components: a real standalone process, its embedded Redis, its runtime
processes, and concurrent loopback clients. Bounded: each test loads for a few seconds.

Every test checks the same promise: clients get a result or a clear 503 (a 502 developer error only for
the activation whose runtime was killed), and no activation answered to a client is missing its record.
``bench/faults.py`` runs the same faults at 200 clients for ``docs/benchmarks/faults.md``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from ow_support.faults import AUTH, NO_ANSWER, Standalone, find_unrecorded, invoker_auth, load, put_action

# The standalone runs in its own process; this test's loop runs only the load generator, whose turns can
# be long when many clients fail at once (a closed port) on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.allow_loop_block]
CLIENTS = 40
SECONDS = 5.0


@pytest.fixture
async def standalone(standalone: Standalone) -> Standalone:
    """The shared standalone with the ``noop`` action the load invokes."""
    await put_action(standalone.url)
    return standalone


async def _warm(server: Standalone) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(f"{server.url}/api/v1/namespaces/_/actions/noop?blocking=true") as r:
            assert r.status == 200, await r.text()


async def test_redis_killed_under_load_is_restarted_and_nothing_answered_is_lost(standalone: Standalone) -> None:
    await _warm(standalone)
    first = await standalone.redis_pid()

    async def kill_redis() -> None:
        os.kill(first, signal.SIGKILL)

    run = await load(standalone.url, clients=CLIENTS, seconds=SECONDS, fault_at=1.5, fault=kill_redis)
    statuses = run.statuses()
    assert set(statuses) <= {200, 202, 503}, statuses
    assert statuses[200] > 0
    assert await standalone.redis_pid() != first
    recovery = run.recovery_s()
    assert recovery is not None and recovery <= 5.0, (recovery, statuses)
    assert await find_unrecorded(standalone.url, run) == []


async def test_health_endpoints_report_redis_down_and_why(standalone: Standalone) -> None:
    pid = await standalone.redis_pid()
    ping = f"{standalone.invoker_urls[0]}/ping"
    health = f"{standalone.invoker_urls[0]}/invoker/health"
    async with aiohttp.ClientSession() as s:
        async with s.get(ping) as r:
            assert (r.status, await r.text()) == (200, "pong")
        # A stopped (not dead) server: nothing restarts it, so the unhealthy state lasts until SIGCONT.
        os.kill(pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(10):
                while True:
                    async with s.get(ping) as r:
                        if r.status == 503:
                            assert (await r.text()).startswith("unhealthy: redis unavailable")
                            break
                    await asyncio.sleep(0.1)
            async with s.get(f"{standalone.url}/") as r:
                body = await r.json()
                assert r.status == 503 and body["error"].startswith("System is unhealthy: redis unavailable")
            async with s.get(f"{standalone.url}/api/v1/namespaces/_/actions", headers=AUTH) as r:
                assert r.status == 503
                assert (await r.json())["error"] == "System is overloaded, try again later."
            async with s.get(health, headers=invoker_auth(standalone)) as r:
                report = await r.json()
                assert r.status == 503 and report["healthy"] is False
                assert report["reasons"][0].startswith("redis unavailable")
                assert report["redis"]["embedded"]["pid"] == pid
            async with s.get(health) as r:
                assert r.status == 401  # the detail is behind the invoker's credentials
        finally:
            os.kill(pid, signal.SIGCONT)
        async with asyncio.timeout(10):
            while True:
                async with s.get(ping) as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
        async with s.get(f"{standalone.url}/") as r:
            assert r.status == 200
        async with s.get(health, headers=invoker_auth(standalone)) as r:
            assert r.status == 200 and (await r.json())["healthy"] is True


async def test_a_warm_runtime_killed_under_load_fails_only_its_activation(standalone: Standalone) -> None:
    await _warm(standalone)
    killed: list[int] = []

    async def kill_runtime() -> None:
        pids = await standalone.runtime_pids()
        assert pids
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    run = await load(standalone.url, clients=CLIENTS, seconds=SECONDS, fault_at=1.5, fault=kill_runtime)
    statuses = run.statuses()
    assert set(statuses) <= {200, 202, 502, 503}, statuses
    # Only activations running in the killed container fail (developer error); a worker runs one at a time.
    assert statuses[502] <= len(killed), statuses
    assert statuses[200] > 0
    assert await find_unrecorded(standalone.url, run) == []


async def test_sigterm_under_load_drains_and_keeps_every_answered_record(standalone: Standalone) -> None:
    await _warm(standalone)
    codes: list[int] = []

    async def terminate() -> None:
        codes.append(await standalone.stop())

    run = await load(standalone.url, clients=CLIENTS, seconds=SECONDS, fault_at=1.5, fault=terminate)
    assert codes == [0]
    statuses = run.statuses()
    # After the listener closes clients are refused (no answer); nothing is answered with an error.
    assert set(statuses) <= {200, 202, 503, NO_ANSWER}, statuses
    assert statuses[200] > 0
    await standalone.start()
    assert await find_unrecorded(standalone.url, run) == []


async def test_one_invoker_of_two_killed_under_load_the_other_serves_and_nothing_is_lost(tmp_path: Path) -> None:
    server = Standalone(tmp_path / "data", args=["--invokers", "2"], killable=True)
    await server.start()
    try:
        await put_action(server.url)
        await load(server.url, clients=8, seconds=0.5)  # containers on both invokers
        alive, doomed = server.invoker_urls
        killed: list[dict[str, object]] = []
        took: list[float] = []

        async def kill_invoker() -> None:
            t0 = time.monotonic()
            killed.append(await server.kill_last_invoker())
            took.append(time.monotonic() - t0)

        run = await load(server.url, clients=CLIENTS, seconds=3.0, fault_at=1.0, fault=kill_invoker,
                         probe=[f"{alive}/ping", f"{doomed}/ping", f"{server.url}/"])
        assert killed and killed[0]["invoker"] == "invoker1", killed
        statuses = run.statuses()
        assert set(statuses) <= {200, 202, 500, 502, 503}, statuses
        # Only activations in flight in the killed invoker's runtimes fail, each with an error record: a
        # developer error (502) when its runtime died under it, at times a whisk internal error (500) when
        # its container went before it ran; the ones waiting in its queue went to the other invoker.
        runtimes = killed[0]["runtime_pids"]
        assert isinstance(runtimes, list) and statuses[500] + statuses[502] <= len(runtimes), statuses
        assert run.fault_at is not None
        down_at = run.fault_at + took[0]  # the invoker is dead from here on
        # Invokes sent once it is dead all go to the other invoker, which serves alone.
        assert {a.status for a in run.answers if a.started > down_at} <= {200}, statuses
        alone = await load(server.url, clients=8, seconds=1.0)
        assert alone.answers and set(alone.statuses()) == {200}, alone.statuses()
        assert await find_unrecorded(server.url, run) == []
        failed = {a.activation_id: a.status for a in run.answers if a.status in (500, 502)}
        async with aiohttp.ClientSession(headers=AUTH) as s:
            for aid, status in failed.items():
                async with s.get(f"{server.url}/api/v1/namespaces/_/activations/{aid}") as r:
                    assert r.status == 200
                    recorded = (await r.json())["response"]["status"]
                    assert recorded == {502: "action developer error", 500: "whisk internal error"}[status]
        # Health tells the truth: the dead invoker's /ping stops answering, the other's and the API's do not.
        late = [(p, status) for t, p, status in run.probes if t > down_at + 0.2]
        assert {status for p, status in late if p.startswith(doomed)} <= {NO_ANSWER}
        assert {status for p, status in late if not p.startswith(doomed)} <= {200}
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{alive}/ping") as r:
                assert (r.status, await r.text()) == (200, "pong")
            with pytest.raises(aiohttp.ClientConnectionError):
                async with s.get(f"{doomed}/ping") as r:
                    pass
    finally:
        await server.kill()
