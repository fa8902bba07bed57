"""A split instance's pipeline stages on the wire: records and start commands carry them, and bad stages are
refused with a clear error instead of reaching the planner or the invoker."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from dilu_invoker.wire import (
    InstanceCommand,
    InstanceRecord,
    InstanceReport,
    StageRecord,
    WireError,
    decode,
    moved_stage_id,
    pack,
    stage_id,
    stage_index,
    stage_parent,
    stage_span,
    unpack,
)

STAGES = (StageRecord(stage_id("llm-1-4", 0), 0, "GPU-a", 0.3, 0.6, 6000),
          StageRecord(stage_id("llm-1-4", 1), 2, "GPU-c", 0.2, 0.4, 14000))


def record(**kw: object) -> InstanceRecord:
    base: dict[str, object] = dict(id="llm-1-4", function="ns/llm", rev="1", invoker="inv0", gpu=0,
                                   gpu_uuid="GPU-a", cls="llm", request=0.5, limit=1.0, memory_mb=20000)
    base.update(kw)
    return InstanceRecord(**base)  # type: ignore[arg-type]


def test_a_record_and_a_command_carry_their_stages_through_the_wire() -> None:
    rec = record(stages=STAGES)
    back = decode(InstanceRecord, pack(rec))
    assert back == rec and back is not None
    assert back.stages == STAGES and isinstance(back.stages, tuple)
    assert back.gpu_reservations() == (("GPU-a", "llm-1-4#p0"), ("GPU-c", "llm-1-4#p1"))
    cmd = InstanceCommand(op="start", epoch=3, instance="llm-1-4", function="ns/llm", gpu=0, gpu_uuid="GPU-a",
                          stages=STAGES)
    assert decode(InstanceCommand, pack(cmd)) == cmd


def test_a_one_gpu_record_has_no_stages_and_reserves_its_own_gpu() -> None:
    rec = record()
    back = decode(InstanceRecord, pack(rec))
    assert back == rec and back is not None and back.stages == ()
    assert back.gpu_reservations() == (("GPU-a", "llm-1-4"),)
    assert record(gpu=None, gpu_uuid=None).gpu_reservations() == ()
    # A record written before the field existed reads as one GPU.
    old = unpack(pack(rec))
    del old["stages"]
    assert InstanceRecord.from_wire(old) == rec


@pytest.mark.parametrize(("stages", "error"), [
    (5, "stages: expected a list, got int"),
    ([{"id": "x"}], "StageRecord: "),
    ([{"id": "x", "gpu": 0, "gpu_uuid": "u", "request": 0.2, "limit": 0.4, "memory_mb": 10}], "at least two"),
    (["not a map", "x"], "StageRecord: expected a map"),
])
def test_bad_stages_are_refused_with_a_clear_error(stages: object, error: str) -> None:
    data = unpack(pack(record()))
    data["stages"] = stages
    with pytest.raises(WireError, match=error):
        InstanceRecord.from_wire(data)
    with pytest.raises(WireError, match=error):
        InstanceCommand.from_wire({"op": "start", "epoch": 1, "instance": "i", "function": "f", "stages": stages})


def test_stage_spans_follow_the_stages_memory_and_cover_the_model() -> None:
    assert stage_span(STAGES, 0) == (0.0, 0.3)
    assert stage_span(STAGES, 1) == (0.3, 1.0)
    three = tuple(StageRecord(stage_id("i", k), k, f"u{k}", 0.1, 0.2, m) for k, m in enumerate((1, 1, 1)))
    spans = [stage_span(three, k) for k in range(3)]
    assert spans[0][0] == 0.0 and spans[-1][1] == 1.0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # No memory declared: equal shares.
    none = tuple(StageRecord(stage_id("i", k), k, f"u{k}", 0.1, 0.2, 0) for k in range(2))
    assert [stage_span(none, k) for k in range(2)] == [(0.0, 0.5), (0.5, 1.0)]


def test_a_stage_id_names_its_instance_and_nothing_else_does() -> None:
    assert stage_parent(stage_id("fn-3-17", 2)) == "fn-3-17"
    assert stage_parent(moved_stage_id("fn-3-17", 2, 40)) == "fn-3-17"
    assert stage_index(stage_id("fn-3-17", 2)) == 2 and stage_index(moved_stage_id("fn-3-17", 3, 40)) == 3
    for other in ("fn-3-17", "#p1", "fn#p", "fn#px", "fn#q1", "", "fn#p1.", "fn#p.3", "fn#p1.x", "fn#p1.2.3"):
        assert stage_parent(other) is None and stage_index(other) is None


def test_a_stage_move_in_flight_holds_the_old_stage_and_the_new_one() -> None:
    new = StageRecord(moved_stage_id("llm-1-4", 1, 9), 3, "GPU-d", 0.2, 0.4, 14000)
    rec = record(stages=(STAGES[0], new), moving=(STAGES[1],))
    back = decode(InstanceRecord, pack(rec))
    assert back == rec and back is not None and isinstance(back.moving, tuple)
    assert back.gpu_reservations() == (("GPU-a", "llm-1-4#p0"), ("GPU-d", "llm-1-4#p1.9"),
                                       ("GPU-c", "llm-1-4#p1"))
    done = replace(back, moving=())
    assert done.gpu_reservations() == (("GPU-a", "llm-1-4#p0"), ("GPU-d", "llm-1-4#p1.9"))
    with pytest.raises(WireError, match="moving: expected a list"):
        InstanceRecord.from_wire({**unpack(pack(rec)), "moving": 7})


def test_a_report_says_how_the_last_stage_move_ended() -> None:
    rep = InstanceReport(id="llm-1-4", function="ns/llm", rev="1", state="ready", moved="llm-1-4#p1.9",
                         move_failed="llm-1-4#p0.8: stage 0 of 2: start failed")
    assert decode(InstanceReport, pack(rep)) == rep
    old = InstanceReport.from_wire({"id": "x", "function": "f", "rev": "1", "state": "ready"})
    assert old.moved == "" and old.move_failed == ""
