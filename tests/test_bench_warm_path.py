"""bench/warm_path.py: the overhead is the client's p50 less the function's own, and the split of it between
the GPU kind, sleeping and GPU work is taken between the right actions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.warm_path import derived, render_run, render_summary, summarize  # noqa: E402


def _raw(client_ms: list[float], run_ms: list[float]) -> dict:
    cpu = {"standalone": 1.0, "runtime proxies": 0.5}
    return {"client_ms": client_ms, "run_ms": run_ms, "cpu": [cpu, {**cpu, "standalone": 3.0}, cpu],
            "batch_overhead_ms": [2.0, 2.5]}


def test_overhead_is_client_p50_less_run_p50_and_the_split_subtracts_the_right_pairs() -> None:
    raw = {
        "cpu-noop": _raw([2.0, 2.2, 9.0], [0.0, 0.0, 0.0]),
        "gpu-noop": _raw([2.1, 2.3, 2.4], [0.0, 0.0, 0.0]),
        "cpu-sleep": _raw([9.0, 9.3, 9.9], [7.0, 7.0, 7.1]),
        "resnet50": _raw([9.6, 9.8, 30.0], [7.0, 7.1, 7.2]),
    }
    rows = summarize(raw)
    assert rows["cpu-noop"]["overhead_p50_ms"] == pytest.approx(2.2)  # medians, so the 9 ms outlier is not in
    assert rows["resnet50"]["overhead_p50_ms"] == pytest.approx(9.8 - 7.1)
    assert rows["cpu-noop"]["cpu_ms_per_invoke"]["standalone"] == 1.0  # the median over batches
    line = derived(rows)[0]
    assert "GPU kind: +0.100 ms" in line  # 2.3 - 2.2
    assert "sleeping: +0.100 ms" in line  # (9.3 - 7.0) - 2.2
    assert "GPU work: +0.400 ms" in line  # (9.8 - 7.1) - (9.3 - 7.0)
    text = render_run("t", rows, "cmd", "machine")
    assert "| resnet50 | 3 | 9.8 |" in text and "2.0–2.5" in text


def test_a_run_without_the_sleeping_action_says_so_rather_than_guess() -> None:
    rows = summarize({"cpu-noop": _raw([2.0], [0.0]), "resnet50": _raw([9.0], [7.0])})
    assert "sleeping: n/a" in derived(rows)[0] and "GPU work: n/a" in derived(rows)[0]


def test_each_client_gets_its_own_split_from_its_own_rows() -> None:
    raw = {
        "cpu-noop": _raw([2.0], [0.0]), "cpu-sleep": _raw([9.5], [7.0]),
        "cpu-noop · socket": _raw([1.0], [0.0]), "cpu-sleep · socket": _raw([8.2], [7.0]),
    }
    lines = derived(summarize(raw))
    assert lines[0].startswith("* aiohttp client:") and "sleeping: +0.500 ms" in lines[0]
    assert lines[1].startswith("* socket client:") and "sleeping: +0.200 ms" in lines[1]


async def test_the_socket_client_keeps_its_connection_and_reads_exactly_each_answer() -> None:
    """Against a real aiohttp server: two requests on one connection, each answer read to its length."""
    import asyncio
    import json

    from aiohttp import web

    from bench.warm_path import SocketClient

    seen: list[tuple[str, dict, str]] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append((request.path_qs, await request.json(), request.headers["Authorization"]))
        return web.json_response({"run_ms": 0.5, "n": len(seen)}, status=200 if len(seen) == 1 else 502)

    app = web.Application()
    app.router.add_post("/a", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client = SocketClient("127.0.0.1", port, "u", "k")
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(None, client.post, "/a?x=1", {"v": 1})
        second = await loop.run_in_executor(None, client.post, "/a", {"v": 2})
        client.close()
    finally:
        await runner.cleanup()
    assert first[0] == 200 and json.loads(first[1]) == {"run_ms": 0.5, "n": 1}
    assert second[0] == 502 and json.loads(second[1])["n"] == 2
    assert [(p, b) for p, b, _ in seen] == [("/a?x=1", {"v": 1}), ("/a", {"v": 2})]
    assert seen[0][2] == "Basic dTpr"  # base64("u:k")


def test_the_summary_has_a_row_per_run_and_a_dash_where_a_run_lacks_an_action_or_a_client() -> None:
    old = summarize({"cpu-noop": _raw([2.0, 2.2, 2.4], [0.0, 0.0, 0.0]),
                     "resnet50": _raw([9.6, 9.8, 30.0], [7.0, 7.1, 7.2])})
    new = summarize({"resnet50 · socket": _raw([8.0, 8.5, 9.0], [7.0, 7.1, 7.2])})
    lines = render_summary([("old", old), ("new", new)]).splitlines()
    assert lines[2] == "| run | cpu-noop · aiohttp | cpu-noop · socket | resnet50 · aiohttp | resnet50 · socket |"
    assert lines[4] == "| old | 2.20 | — | 2.70 | — |"
    assert lines[5] == "| new | — | — | — | 1.40 |"
