"""Placement event files: parsing, ordering and the errors a user sees."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from dilu_invoker.policy import InstanceClass
from dilu_invoker.sim.events import EventError, load_events, read_events, write_events

CREATE = {
    "t": 1.0,
    "op": "create",
    "instance": "a",
    "function": "f",
    "class": "llm",
    "gpus": 1,
    "mem_gib_per_gpu": 24.0,
    "sm_request": 0.5,
    "sm_limit": 0.7,
}


def lines(*objs: object) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_create_and_delete_parse() -> None:
    evs = read_events(lines(CREATE, {"t": 5, "op": "delete", "instance": "a"}))
    c, d = evs
    assert c.spec is not None and c.spec.cls is InstanceClass.LLM
    assert c.spec.memory_mib == 24.0 * 1024
    assert (d.op, d.instance, d.spec, d.line) == ("delete", "a", None, 2)


def test_equal_times_keep_file_order_and_others_sort() -> None:
    evs = read_events(
        lines(
            {**CREATE, "t": 9, "instance": "late"},
            {"t": 2, "op": "delete", "instance": "x"},
            {**CREATE, "t": 2, "instance": "y"},
        )
    )
    assert [(e.t, e.instance) for e in evs] == [(2.0, "x"), (2.0, "y"), (9.0, "late")]


def test_comments_and_blank_lines_are_skipped() -> None:
    assert len(read_events(["# a comment", "", json.dumps(CREATE)])) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({**CREATE, "op": "move"}), "op must be"),
        (json.dumps({**CREATE, "class": "batch"}), "unknown instance class"),
        (json.dumps({**CREATE, "sm_request": 0.9}), "exceeds sm_limit"),
        (json.dumps({**CREATE, "sm_limit": 1.5}), "between 0 and 1"),
        (json.dumps({**CREATE, "gpus": 0}), "gpus must be"),
        (json.dumps({**CREATE, "gpus": 1.5}), "gpus must be"),
        (json.dumps({**CREATE, "t": -1}), "t must be >= 0"),
        (json.dumps({**CREATE, "t": "soon"}), "t must be a finite number"),
        (json.dumps({**CREATE, "colour": "red"}), "unknown field"),
        (json.dumps({k: v for k, v in CREATE.items() if k != "mem_gib_per_gpu"}), "missing field 'mem_gib_per_gpu'"),
        (json.dumps({"t": 1, "op": "delete"}), "instance must be"),
    ],
    ids=[
        "json",
        "not-object",
        "op",
        "class",
        "request-over-limit",
        "limit-over-one",
        "gpus-zero",
        "gpus-float",
        "negative-time",
        "time-text",
        "unknown-field",
        "missing-memory",
        "delete-without-instance",
    ],
)
def test_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(EventError, match=message) as info:
        read_events([json.dumps(CREATE), line], "trace.jsonl")
    assert "trace.jsonl:2" in str(info.value)


def test_an_empty_file_is_an_error() -> None:
    with pytest.raises(EventError, match="no events"):
        read_events(["", "# nothing"])


def test_roundtrip_plain_and_gzip(tmp_path: Path) -> None:
    evs = read_events(lines(CREATE, {"t": 5, "op": "delete", "instance": "a"}))
    buf = io.StringIO()
    assert write_events(evs, buf) == 2
    plain = tmp_path / "e.jsonl"
    plain.write_text(buf.getvalue())
    packed = tmp_path / "e.jsonl.gz"
    with gzip.open(packed, "wt") as fh:
        fh.write(buf.getvalue())
    for path in (plain, packed):
        again = load_events(path)
        assert [(e.t, e.op, e.instance, e.spec) for e in again] == [(e.t, e.op, e.instance, e.spec) for e in evs]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EventError, match="cannot read"):
        load_events(tmp_path / "nope.jsonl")
