"""A split instance's tensor crosses from stage to stage as a stage frame (its bytes as they are: no base64, no JSON,
not parsed by the invoker) on the direct lane and over HTTP to a runtime that takes them (the Docker backend's path),
and as base64 in JSON to a runtime that does not say so at /init, with the same results each way: a real invoker
(process backend, two inventory GPUs), real runtime processes, a real Redis."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from dilu_invoker.invoker.dataplane import runtime_client
from dilu_invoker.model import ActivationStatus, Exec
from dilu_invoker.wire import InstanceState
from tests.invoker.test_split_instances import UUIDS, Node, _action, _req, _stages, running_node

# Stage 0 sends `n` float32s (i * scale) with a tag; stage 1 says what it got and in which form its data came.
CODE = '''
import os
import numpy as np
from dilu_invoker.actions import pipeline

def main(args):
    if os.environ["DILU_STAGE_INDEX"] == "0":
        out = pipeline.send(np.arange(args["n"], dtype=np.float32) * args["scale"], tag=args["tag"],
                            last_sends=args.get("last_sends", False))
        if args.get("fail"):
            out["error"] = "stage 0 gave up"
        return out
    form = type(args["dilu_stage"]["data"]).__name__
    x, meta = pipeline.receive(args, as_numpy=True)
    if meta["last_sends"]:
        return pipeline.send(x[:4])
    return {"sum": float(x.astype(np.float64).sum()), "n": int(x.size), "tag": meta["tag"], "form": form}
'''


@pytest.fixture(params=["lane", "http", "json"])
async def node(request: pytest.FixtureRequest, tmp_path: Path, redis: aioredis.Redis,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    if request.param == "json":
        # a runtime that does not say it takes stage frames (one older than them): the invoker reads another header
        monkeypatch.setattr(runtime_client, "STAGE_FRAMES_HEADER", "X-Not-Said")
    action = replace(_action("tensors"), exec=Exec(kind="python:3-gpu", code=CODE))
    async with running_node(tmp_path, redis, UUIDS, action, Node, direct_lane=request.param == "lane") as n:
        assert await n.start("t-1", _stages("t-1")) == "start" and n.state("t-1") is InstanceState.READY
        yield n


async def test_a_tensor_crosses_as_a_frame_where_the_runtime_takes_them_else_as_base64(
        node: Node, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = request.node.callspec.id != "json"
    staged: list[bool] = []
    outcome = runtime_client.run_outcome

    def spy(**kw: object) -> runtime_client.RuntimeOutcome:
        staged.append(bool(kw.get("staged")))
        return outcome(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime_client, "run_outcome", spy)
    n = 1_000_000  # 4 MB of float32
    activation = await node.manager.run("t-1", _req(node.action, n=n, scale=0.5, tag="a"))
    assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, activation
    assert activation.response.result == {"sum": 0.5 * n * (n - 1) / 2, "n": n, "tag": "a",
                                          "form": "Blob" if frames else "str"}
    # stage 0's answer came as a stage frame where frames are taken; the last stage's is JSON either way
    assert staged == ([True, False] if frames else [False, False])


async def test_a_stage_error_beside_a_tensor_ends_the_activation_there(node: Node) -> None:
    activation = await node.manager.run("t-1", _req(node.action, n=10, scale=1.0, tag="b", fail=True))
    assert activation is not None and activation.response.status is ActivationStatus.APPLICATION_ERROR
    assert activation.response.result == {"error": "stage 0 of 2: stage 0 gave up"}
    # and the instance serves on
    again = await node.manager.run("t-1", _req(node.action, n=10, scale=1.0, tag="c"))
    assert again is not None and again.response.result["sum"] == 45.0


async def test_a_last_stage_that_sends_a_tensor_answers_json(node: Node) -> None:
    activation = await node.manager.run("t-1", _req(node.action, n=10, scale=2.0, tag="d", last_sends=True))
    assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, activation
    wire = activation.response.result["dilu_stage"]
    # the activation's result is JSON (its record is stored as such): the tensor as base64 text, never bytes
    assert isinstance(wire["data"], str) and wire["shape"] == [4]
    assert np.frombuffer(base64.b64decode(wire["data"]), dtype="<f4").tolist() == [0.0, 2.0, 4.0, 6.0]
