"""The activation sentinel in an action's own output cannot end its logs or move them into the next
activation's record: the runtime escapes it (``ESCAPED_SENTINEL``), and only the runtime's own sentinel
line ends an activation's output."""

from __future__ import annotations

import io
import textwrap

import aiohttp

from dilu_invoker.actions._ipc import ESCAPED_SENTINEL, SENTINEL
from dilu_invoker.actions.worker import SentinelEscapingStream
from tests.fakes.bodies import init_body, post, run_body
from tests.fakes.runtime_process import running_runtime

PRINTS_SENTINELS = textwrap.dedent(
    f"""
    import sys

    S = {SENTINEL!r}

    def main(args):
        print("before", args["n"])
        print(S)                                   # alone on its line
        sys.stdout.write("glued" + S + "\\n")       # at the end of a line
        sys.stdout.write(S[:10]); sys.stdout.write(S[10:] + "\\n")  # split over two writes
        print(S, file=sys.stderr)
        print("after", args["n"])
        sys.stdout.write("XXX")                    # a possible start, left at the end of the run
        return {{}}
    """
).lstrip("\n")


async def test_an_action_printing_the_sentinel_keeps_its_logs_in_its_own_record(
    http: aiohttp.ClientSession,
) -> None:
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(PRINTS_SENTINELS))
        for n in (1, 2):
            status, _ = await post(http, rt.url + "/run", run_body({"n": n}))
            assert status == 200
        for n in (1, 2):
            out, err = await rt.frames()
            assert out.lines == [f"before {n}", ESCAPED_SENTINEL, "glued" + ESCAPED_SENTINEL, ESCAPED_SENTINEL,
                                 f"after {n}", "XXX"]
            assert err.lines == [ESCAPED_SENTINEL]


def test_escaping_across_writes_and_release() -> None:
    sink = io.StringIO()
    stream = SentinelEscapingStream(sink)
    for piece in ("a", SENTINEL[:1], SENTINEL[1:20], SENTINEL[20:], "b\nXX"):
        assert stream.write(piece) == len(piece)
    assert sink.getvalue() == "a" + ESCAPED_SENTINEL + "b\n"
    stream.release()
    assert sink.getvalue() == "a" + ESCAPED_SENTINEL + "b\nXX"
    stream.write("XXX_THE_START")  # not the sentinel after all: passes through unchanged
    stream.release()
    assert sink.getvalue() == "a" + ESCAPED_SENTINEL + "b\nXX" + "XXX_THE_START"
