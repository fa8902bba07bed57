"""The process backend's direct lane: warm /run goes from the invoker to the initialised worker and back
without the runtime proxy's HTTP, with the proxy's answers and logs in every failure."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dilu_invoker.actions._ipc import Kind, pack
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.invoker.dataplane.runtime_client import DirectLane, LaneClosed
from dilu_invoker.model import ActivationStatus
from tests.ow_support.invoker import activation as _req
from tests.ow_support.invoker import config_with as _cfg
from tests.ow_support.invoker import python_action as _action


def _lane(inv: Invoker) -> DirectLane:
    (proxy,) = [p for p in inv.pool.containers.values() if p.container is not None]
    assert proxy.container is not None
    lane = proxy.container.lane
    assert isinstance(lane, DirectLane)
    return lane


async def test_warm_runs_take_the_lane_and_answer_as_over_http(invoker: Invoker) -> None:
    action = _action()
    first = await invoker.run(_req(action, {"n": 1}))
    lane = _lane(invoker)
    for n in (2, 3):
        got = await invoker.run(_req(action, {"n": n}))
        assert got.response.status is ActivationStatus.SUCCESS and got.response.result == {"n": n}
        assert [line.split(" stdout: ")[1] for line in got.logs] == [f"hello {n}"]
    assert first.response.result == {"n": 1} and lane.runs == 3


async def test_without_the_lane_runs_go_over_http_with_the_same_answers() -> None:
    async with open_invoker(_cfg(user_memory_mb=1024, idle_timeout_s=60, process_direct_lane=False)) as inv:
        got = await inv.run(_req(_action(), {"n": 4}))
        assert got.response.result == {"n": 4}
        (proxy,) = [p for p in inv.pool.containers.values() if p.container is not None]
        assert getattr(proxy.container, "lane", None) is None


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "http"])
async def test_a_worker_that_dies_mid_run_gets_the_proxys_answer_and_log_line(lane: bool) -> None:
    code = "import os\ndef main(args):\n    if args.get('die'):\n        print('going')\n        os._exit(3)\n    return {}\n"
    action = _action(code, name="dies")
    async with open_invoker(_cfg(user_memory_mb=1024, idle_timeout_s=60, process_direct_lane=lane)) as inv:
        assert (await inv.run(_req(action))).response.status is ActivationStatus.SUCCESS
        died = await inv.run(_req(action, {"die": True}))
        assert died.response.status is ActivationStatus.DEVELOPER_ERROR
        assert died.response.result == {"error": "command exited"}
        lines = [line.split(": ", 1)[1] for line in died.logs]
        assert "going" in lines and any("dilu-runtime:" in line and "code 3" in line for line in lines), lines
        # The container is replaced; the function keeps running.
        again = await inv.run(_req(action))
        assert again.response.status is ActivationStatus.SUCCESS and again.annotation("initTime") is not None


async def test_a_result_over_the_limit_is_refused_as_over_http_and_the_lane_stays_usable(invoker: Invoker) -> None:
    code = "def main(args):\n    return {'x': 'a' * int(args.get('size', 1))}\n"
    action = _action(code, name="big")
    assert (await invoker.run(_req(action))).response.result == {"x": "a"}
    big = await invoker.run(_req(action, {"size": 2 * 1024 * 1024}))
    assert big.response.status is ActivationStatus.APPLICATION_ERROR
    assert "exceeded the allowed length" in str(big.response.result["error"])
    small = await invoker.run(_req(action, {"size": 2}))
    assert small.response.result == {"x": "aa"} and _lane(invoker).runs == 3 and not _lane(invoker).closed


async def test_garbage_written_to_the_lane_fails_only_that_run(invoker: Invoker) -> None:
    # The worker's end of the lane is its last argument: an action can write to it, hurting only itself.
    code = ("import socket, sys\n"
            "def main(args):\n"
            "    if args.get('garble'):\n"
            "        socket.socket(fileno=int(sys.argv[-1])).sendall(b'\\xff' * 64)\n"
            "    return {'ok': True}\n")
    action = _action(code, name="garble")
    assert (await invoker.run(_req(action))).response.result == {"ok": True}
    lane = _lane(invoker)
    garbled = await invoker.run(_req(action, {"garble": True}))
    assert garbled.response.status is ActivationStatus.DEVELOPER_ERROR and lane.closed
    # As any developer error, it cost the container; the next run gets a fresh one.
    after = await invoker.run(_req(action))
    assert after.response.result == {"ok": True} and _lane(invoker) is not lane


async def _pair() -> tuple[DirectLane, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await DirectLane.open(ours), theirs


async def _answer(theirs: socket.socket, *frames: bytes, chunk: int = 7) -> None:
    data = b"".join(frames)
    for i in range(0, len(data), chunk):  # in small pieces: frames split across reads
        await asyncio.get_running_loop().sock_sendall(theirs, data[i:i + chunk])


async def test_lane_frames_split_kept_to_the_limit_and_matched_by_id() -> None:
    lane, theirs = await _pair()
    theirs.setblocking(False)
    try:
        first = asyncio.ensure_future(lane.request(b"{}", limit=10))
        second = asyncio.ensure_future(lane.request(b"{}", limit=10))
        await asyncio.sleep(0.05)
        # answered out of order; the first longer than its limit
        await _answer(theirs, pack(Kind.RESULT_NOT_DICT, 2, b""), pack(Kind.RESULT, 1, b"x" * 25))
        assert await asyncio.wait_for(second, 2) == (Kind.RESULT_NOT_DICT, b"", 0)
        assert await asyncio.wait_for(first, 2) == (Kind.RESULT, b"x" * 10, 25)
        assert lane.runs == 2 and not lane.closed
    finally:
        theirs.close()
        lane.close()


async def test_lane_closed_before_or_during_a_request_says_which() -> None:
    lane, theirs = await _pair()
    pending = asyncio.ensure_future(lane.request(b"{}", limit=10))
    await asyncio.sleep(0.05)
    theirs.close()
    with pytest.raises(LaneClosed) as during:
        await asyncio.wait_for(pending, 2)
    assert during.value.sent is True
    with pytest.raises(LaneClosed) as before:
        await lane.request(b"{}", limit=10)
    assert before.value.sent is False


async def test_a_frame_of_unknown_kind_closes_the_lane() -> None:
    lane, theirs = await _pair()
    theirs.setblocking(False)
    pending = asyncio.ensure_future(lane.request(b"{}", limit=10))
    await asyncio.sleep(0.05)
    await _answer(theirs, bytes([250]) + b"\0" * 16)
    with pytest.raises(LaneClosed):
        await asyncio.wait_for(pending, 2)
    theirs.close()
