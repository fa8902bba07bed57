"""The stderr progress printer: quiet for quick runs, a line per quarter in logs, a bar on terminals."""

from __future__ import annotations

import io

from dilu_invoker.sim.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quick_runs_print_nothing() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("x", 100, stream=out, clock=clock)
    for i in range(100):
        clock.t = i * 0.001
        p.update(i)
    p.close()
    assert out.getvalue() == ""


def test_logs_get_a_line_per_quarter_after_two_seconds() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("sim", 100, stream=out, clock=clock)
    for i in range(101):
        clock.t = i * 0.1
        p.update(i)
    p.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[1].split("%")[0].strip() for ln in lines[:-1]] == ["20", "25", "50", "75", "100"]
    assert lines[-1].startswith("sim: done in")


def test_terminal_gets_a_redrawn_bar() -> None:
    out, clock = Tty(), Clock()
    p = Progress("sim", 10, stream=out, clock=clock)
    for i in range(11):
        clock.t = i * 0.3
        p.update(i)
    p.close()
    text = out.getvalue()
    assert text.count("\r") >= 2 and "[####" in text and text.endswith("\n")


def test_disabled_prints_nothing() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("x", 10, stream=out, clock=clock, enabled=False)
    clock.t = 100.0
    p.update(5)
    p.close()
    assert out.getvalue() == ""
