"""dilu_invoker.actions.pipeline: a stage's layers tile the model whatever the spans, the stage variables are
parsed strictly, tensors survive send → JSON → receive, and two real runtimes run a split model as one."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import random
import subprocess
import sys
import textwrap
from typing import Any

import aiohttp
import numpy as np
import pytest

from dilu_invoker.actions import pipeline
from dilu_invoker.actions._ipc import (
    STAGE_CONTENT_TYPE,
    STAGE_FRAMES_HEADER,
    WELCOME_BLOB,
    Blob,
    json_default,
    pack_stage,
    take_blob,
    unpack_stage,
)
from dilu_invoker.actions.pipeline import ENV_COUNT, ENV_INDEX, ENV_SPAN, Stage
from tests.fakes.bodies import init_body, post, run_body
from tests.fakes.runtime_process import REPO_ROOT, running_runtime

HAS_TORCH = importlib.util.find_spec("torch") is not None


def wire(result: dict[str, Any]) -> dict[str, Any]:
    """What the next stage's `main` gets over HTTP: the result after the runtime's JSON (the tensor's bytes as
    base64) and the invoker's."""
    return json.loads(json.dumps(result, separators=(",", ":"), default=json_default))


# -- layers ----------------------------------------------------------------------------------------------


def tile(n: int, cuts: list[float]) -> list[range]:
    count = len(cuts) - 1
    return [Stage(k, count, (cuts[k], cuts[k + 1])).layers(n) for k in range(count)]


def random_cuts(rng: random.Random, count: int) -> list[float]:
    inner = sorted(rng.random() for _ in range(count - 1))
    if count > 2 and rng.random() < 0.3:
        inner[rng.randrange(count - 2)] = inner[-1]  # zero-width spans: a stage with (almost) no memory
    return [0.0, *sorted(inner), 1.0]


def test_layers_tile_the_model_and_none_is_empty_whenever_there_are_enough_layers() -> None:
    rng = random.Random(20261207)
    cases = 0
    for _ in range(4000):
        count = rng.randint(1, 9)
        n = rng.randint(0, 40)
        ranges = tile(n, random_cuts(rng, count))
        assert [i for r in ranges for i in r] == list(range(n)), (n, count, ranges)
        assert all(r.step == 1 for r in ranges)
        if n >= count:
            assert all(len(r) >= 1 for r in ranges), (n, count, ranges)
        cases += 1
    assert cases == 4000


@pytest.mark.parametrize(("n", "count"), [(24, 2), (24, 3), (24, 4), (80, 8), (7, 7), (32, 5)])
def test_an_even_split_is_plain_rounding(n: int, count: int) -> None:
    ranges = tile(n, [k / count for k in range(count)] + [1.0])
    for k, r in enumerate(ranges):
        assert r.start == int(k * n / count + 0.5)
    assert ranges[-1].stop == n


def test_two_stages_are_within_one_layer_of_their_share() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n, cut = rng.randint(2, 200), rng.random()
        first, second = tile(n, [0.0, cut, 1.0])
        assert abs(first.stop - int(cut * n + 0.5)) <= 1  # within one layer of plain rounding
        assert first.stop == second.start


def test_spans_from_the_stage_records_tile_through_the_environment() -> None:
    """wire.stage_span makes the spans the invoker writes; each stage parses its own variables."""
    from dilu_invoker.wire import StageRecord, stage_span  # here: the module above needs only the runtime's dependencies

    stages = tuple(StageRecord(f"i#p{k}", k, None, 0.5, 1.0, mb) for k, mb in enumerate((30000, 9000, 41000)))
    ranges = []
    for k in range(len(stages)):
        a, b = stage_span(stages, k)
        env = {ENV_INDEX: str(k), ENV_COUNT: str(len(stages)), ENV_SPAN: f"{a!r}:{b!r}"}
        me = pipeline.stage(env)
        assert me.span == (a, b) and me.first == (k == 0) and me.last == (k == 2)
        ranges.append(me.layers(32))
    assert ranges == [range(0, 12), range(12, 16), range(16, 32)]


def test_fewer_layers_than_stages_still_tile() -> None:
    ranges = tile(2, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert [i for r in ranges for i in r] == [0, 1]
    assert sum(1 for r in ranges if not r) == 2


def test_negative_layer_count_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        Stage(0, 1, (0.0, 1.0)).layers(-1)


# -- the environment -------------------------------------------------------------------------------------


def test_an_ordinary_instance_is_the_one_whole_stage() -> None:
    me = pipeline.stage({"PATH": "/bin"})
    assert me == Stage(0, 1, (0.0, 1.0))
    assert me.first and me.last and me.layers(24) == range(24)


def test_the_stage_comes_from_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_INDEX, "1")
    monkeypatch.setenv(ENV_COUNT, "2")
    monkeypatch.setenv(ENV_SPAN, "0.625:1.0")
    me = pipeline.stage()
    assert me == Stage(1, 2, (0.625, 1.0))
    assert not me.first and me.last
    assert me.layers(10) == range(6, 10)  # 1 + round(0.625 * 8)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({ENV_INDEX: "one", ENV_COUNT: "2", ENV_SPAN: "0:0.5"}, ENV_INDEX),
        ({ENV_INDEX: "0", ENV_COUNT: "2.0", ENV_SPAN: "0:0.5"}, ENV_COUNT),
        ({ENV_INDEX: "0", ENV_COUNT: "0", ENV_SPAN: "0:1"}, ENV_COUNT),
        ({ENV_INDEX: "2", ENV_COUNT: "2", ENV_SPAN: "0.5:1"}, ENV_INDEX),
        ({ENV_INDEX: "-1", ENV_COUNT: "2", ENV_SPAN: "0:0.5"}, ENV_INDEX),
        ({ENV_INDEX: "0", ENV_COUNT: "2", ENV_SPAN: "0.5"}, ENV_SPAN),
        ({ENV_INDEX: "0", ENV_COUNT: "2", ENV_SPAN: "0:0.5:1"}, ENV_SPAN),
        ({ENV_INDEX: "0", ENV_COUNT: "2", ENV_SPAN: "zero:half"}, ENV_SPAN),
        ({ENV_INDEX: "1", ENV_COUNT: "3", ENV_SPAN: "0.6:0.4"}, ENV_SPAN),
        ({ENV_INDEX: "1", ENV_COUNT: "2", ENV_SPAN: "0.5:1.5"}, ENV_SPAN),
        ({ENV_INDEX: "1", ENV_COUNT: "3", ENV_SPAN: "nan:0.5"}, ENV_SPAN),
        ({ENV_INDEX: "0", ENV_COUNT: "2", ENV_SPAN: "0.1:0.5"}, ENV_SPAN),
        ({ENV_INDEX: "1", ENV_COUNT: "2", ENV_SPAN: "0.5:0.9"}, ENV_SPAN),
        ({ENV_INDEX: "0", ENV_COUNT: "2"}, ENV_SPAN),
        ({ENV_SPAN: "0:0.5"}, ENV_INDEX),
    ],
    ids=["index-word", "count-float", "count-zero", "index-too-big", "index-negative", "span-one-number",
         "span-three-numbers", "span-words", "span-reversed", "span-past-one", "span-nan", "first-not-at-zero",
         "last-not-at-one", "span-missing", "index-missing"],
)
def test_malformed_variables_are_a_value_error_naming_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        pipeline.stage(env)


# -- send and receive ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 0, 4), (), (1, 7, 16)], ids=["2d", "empty", "scalar", "3d"])
def test_numpy_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 1000).astype(dtype)
    message = wire(pipeline.send(x, max_tokens=16, stop=["\n"]))
    assert set(message) == {"dilu_stage", "max_tokens", "stop"}
    assert message["dilu_stage"]["dtype"] == dtype and message["dilu_stage"]["shape"] == list(shape)
    y, meta = pipeline.receive(message, as_numpy=True)
    assert meta == {"max_tokens": 16, "stop": ["\n"]}
    assert y.dtype == np.dtype(dtype) and y.shape == shape
    assert np.array_equal(x, y)
    y[...] = 0  # a writable array of its own


def test_a_non_contiguous_array_is_sent_in_its_logical_order() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4).T
    y, _ = pipeline.receive(wire(pipeline.send(x)), as_numpy=True)
    assert y.shape == (4, 3) and np.array_equal(x, y)


def test_the_payload_is_the_raw_little_endian_bytes() -> None:
    x = np.array([1.0, -2.0], dtype=">f4")  # big-endian in, little-endian on the wire
    data = pipeline.send(x)["dilu_stage"]["data"]
    assert isinstance(data, Blob) and data == np.array([1.0, -2.0], dtype="<f4").tobytes()
    assert base64.b64decode(wire(pipeline.send(x))["dilu_stage"]["data"]) == data  # base64 in JSON


@pytest.mark.parametrize("form", [bytes, bytearray, memoryview, Blob], ids=lambda f: f.__name__)
def test_receive_takes_the_bytes_of_a_stage_frame(form: Any) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    message = pipeline.send(x, n=2)
    message["dilu_stage"]["data"] = form(bytes(message["dilu_stage"]["data"]))
    y, meta = pipeline.receive(message, as_numpy=True)
    assert meta == {"n": 2} and np.array_equal(x, y)
    message["dilu_stage"]["data"] = form(bytes(message["dilu_stage"]["data"])[:-1])
    with pytest.raises(ValueError, match="holds 47 bytes"):
        pipeline.receive(message, as_numpy=True)


def test_a_blob_is_json_only_through_the_runtimes_encoder() -> None:
    with pytest.raises(TypeError, match="Blob is not JSON serializable"):
        json.dumps(pipeline.send(np.zeros(2)))
    with pytest.raises(TypeError, match="bytes is not JSON serializable"):
        json.dumps({"x": b"ab"}, default=json_default)  # only a Blob is the runtime's to write


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed here")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_torch_round_trip_keeps_the_dtype(dtype: str) -> None:
    import torch

    x = (torch.randn(4, 3, 8) * 100).to(getattr(torch, dtype))
    y, meta = pipeline.receive(wire(pipeline.send(x, step=3)), device="cpu")
    assert meta == {"step": 3}
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(x, y)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed here")
def test_torch_bfloat16_read_as_numpy_is_its_bits() -> None:
    import torch

    x = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    y, _ = pipeline.receive(wire(pipeline.send(x)), as_numpy=True)
    assert y.dtype == np.uint16 and y.tolist() == x.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()


def _message(**changes: Any) -> dict[str, Any]:
    message = pipeline.send(np.arange(6, dtype=np.float32).reshape(2, 3), n=1)
    message["dilu_stage"].update(changes)
    return message


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"x": [1, 2]}, "no 'dilu_stage' field"),
        ([1, 2], "no 'dilu_stage' field"),
        ({"dilu_stage": "abc"}, "not an object"),
        (_message(data="not base64!"), "not valid base64"),
        (_message(data=base64.b64encode(b"\0" * 20).decode()), "holds 20 bytes, but float32 of shape \\[2, 3\\] is 24"),
        (_message(shape=[3, 3]), "holds 24 bytes, but float32 of shape \\[3, 3\\] is 36"),
        (_message(dtype="float64"), "holds 24 bytes, but float64"),
        (_message(dtype="complex64"), "dtype 'complex64' is not one of"),
        (_message(shape=[2, -3]), "not a list of non-negative integers"),
        (_message(shape=[True, 3]), "not a list of non-negative integers"),
        (_message(shape="2x3"), "not a list of non-negative integers"),
        (_message(data=None), "not a base64 string"),
    ],
    ids=["no-field", "a-list", "field-not-object", "bad-base64", "short-data", "wrong-shape", "wrong-dtype",
         "unknown-dtype", "negative-dim", "bool-dim", "shape-string", "no-data"],
)
def test_bad_payloads_are_a_clear_value_error(args: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pipeline.receive(args, as_numpy=True)


def test_what_send_refuses() -> None:
    with pytest.raises(TypeError, match="torch tensor or a numpy array, not list"):
        pipeline.send([1.0, 2.0])
    with pytest.raises(ValueError, match="JSON values"):
        pipeline.send(np.zeros(2), when=object())
    with pytest.raises(ValueError, match="the tensor's field"):
        pipeline.send(np.zeros(2), dilu_stage=1)
    with pytest.raises(ValueError, match="complex64"):
        pipeline.send(np.zeros(2, dtype=np.complex64))


def test_the_module_imports_and_parses_without_numpy_or_torch() -> None:
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("numpy", "torch"):
                    raise ImportError("blocked: " + name)

        sys.meta_path.insert(0, Block())
        from dilu_invoker.actions import pipeline
        print(pipeline.stage({"DILU_STAGE_INDEX": "1", "DILU_STAGE_COUNT": "2", "DILU_STAGE_SPAN": "0.5:1"}).layers(8))
        try:
            pipeline.send([1])
        except TypeError as exc:
            print("send:", exc)
        try:
            pipeline.receive({"dilu_stage": {"dtype": "uint8", "shape": [1], "data": "AA=="}})
        except RuntimeError as exc:
            print("receive:", exc)
        print("numpy" in sys.modules, "torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "range(4, 8)",
        "send: send takes a torch tensor or a numpy array, not list",
        "receive: receive needs numpy or torch, and neither is installed",
        "False False",
    ]


# -- two real runtimes -----------------------------------------------------------------------------------

SPLIT_MODEL = textwrap.dedent(
    """
    import numpy as np
    from dilu_invoker.actions import pipeline

    LAYERS, WIDTH, SEED = 7, 16, 1234
    me = pipeline.stage()
    mine = me.layers(LAYERS)
    # Each layer's weights come from (seed, layer) alone, so a stage builds only its own.
    weights = {i: np.random.default_rng([SEED, i]).standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH) for i in mine}

    def main(args):
        if me.first:
            x, meta = np.asarray(args["x"], dtype=np.float64), {"tag": args["tag"]}
        else:
            x, meta = pipeline.receive(args, as_numpy=True)
        for i in mine:
            x = np.tanh(x @ weights[i])
        meta = {**meta, "layers": [*meta.get("layers", []), [mine.start, mine.stop]]}
        if me.last:
            return {"y": x.tolist(), **meta}
        return pipeline.send(x, **meta)
    """
)


def stage_env(index: int, count: int, span: str) -> dict[str, str]:
    return {ENV_INDEX: str(index), ENV_COUNT: str(count), ENV_SPAN: span}


async def test_two_runtime_stages_compute_what_one_unsplit_runtime_does(http: aiohttp.ClientSession) -> None:
    x = np.random.default_rng(5).standard_normal((3, 16)).round(6).tolist()
    async with contextlib.AsyncExitStack() as stack:
        whole, first, second = await asyncio.gather(*(stack.enter_async_context(running_runtime()) for _ in range(3)))
        inits = await asyncio.gather(
            post(http, whole.url + "/init", init_body(SPLIT_MODEL)),
            post(http, first.url + "/init", init_body(SPLIT_MODEL, env=stage_env(0, 2, "0:0.4"))),
            post(http, second.url + "/init", init_body(SPLIT_MODEL, env=stage_env(1, 2, "0.4:1"))),
        )
        assert inits == [(200, {"ok": True})] * 3
        params = {"x": x, "tag": "req-1"}
        status, expected = await post(http, whole.url + "/run", run_body(params))
        assert status == 200 and expected["layers"] == [[0, 7]]
        status, middle = await post(http, first.url + "/run", run_body(params))
        assert status == 200 and middle["dilu_stage"]["shape"] == [3, 16] and middle["layers"] == [[0, 3]]
        status, result = await post(http, second.url + "/run", run_body(middle))
        assert status == 200, result
        assert result["tag"] == "req-1" and result["layers"] == [[0, 3], [3, 7]]  # 1 + round(0.4 * 5) = 3
        assert np.allclose(result["y"], expected["y"], rtol=1e-12, atol=1e-12)
        assert not np.allclose(result["y"], np.tanh(np.asarray(x)), atol=1e-3)  # the layers did something
        # Stage 1 given the activation's params (not stage 0's result) says what it lacks.
        status, wrong = await post(http, second.url + "/run", run_body(params))
        assert status == 200 and "no 'dilu_stage' field" in wrong["error"]


def documented_example() -> str:
    """The complete action of docs/runtime.md's "Pipeline stages" section, made small."""
    text = (REPO_ROOT / "docs" / "runtime.md").read_text()
    section = text.split("## Pipeline stages (split instances)", 1)[1].split("\n## ", 1)[0]
    source = section.split("A complete action", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    sizes = "LAYERS, D, HEADS, VOCAB = 24, 1024, 16, 32000\n"
    assert sizes in source
    return source.replace(sizes, "LAYERS, D, HEADS, VOCAB = 5, 32, 4, 50\n")


def test_the_documented_example_is_the_one_tested() -> None:
    source = documented_example()
    compile(source, "example", "exec")
    assert "pipeline.stage()" in source and "pipeline.receive(args)" in source and "pipeline.send(x, **meta)" in source


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed here")
async def test_the_documented_example_split_in_two_answers_as_whole(http: aiohttp.ClientSession) -> None:
    source = documented_example()
    async with contextlib.AsyncExitStack() as stack:
        whole, first, second = await asyncio.gather(*(stack.enter_async_context(running_runtime()) for _ in range(3)))
        inits = await asyncio.gather(
            post(http, whole.url + "/init", init_body(source)),
            post(http, first.url + "/init", init_body(source, env=stage_env(0, 2, "0:0.5"))),
            post(http, second.url + "/init", init_body(source, env=stage_env(1, 2, "0.5:1"))),
        )
        assert inits == [(200, {"ok": True})] * 3
        for tokens in ([1, 2, 3], [7, 0, 49, 12, 5]):
            params = {"tokens": tokens, "max_tokens": 4}
            status, expected = await post(http, whole.url + "/run", run_body(params))
            assert status == 200 and set(expected) == {"next_token", "max_tokens"}, expected
            status, middle = await post(http, first.url + "/run", run_body(params))
            assert status == 200 and middle["dilu_stage"]["shape"] == [1, len(tokens), 32] and middle["max_tokens"] == 4
            assert await post(http, second.url + "/run", run_body(middle)) == (200, expected)


async def test_a_runtime_takes_stage_frames_over_http_and_answers_one(http: aiohttp.ClientSession) -> None:
    """The Docker backend's path: /init says the runtime takes stage frames; a /run whose body is one (content type
    `STAGE_CONTENT_TYPE`) reaches `main` with the tensor's bytes, and a stage that welcomes one answers one; a body
    that is not a stage frame is refused as any unreadable body is."""
    x = np.random.default_rng(9).standard_normal((3, 16)).round(6)
    headers = {"Content-Type": STAGE_CONTENT_TYPE}
    async with contextlib.AsyncExitStack() as stack:
        first, second = await asyncio.gather(*(stack.enter_async_context(running_runtime()) for _ in range(2)))
        for rt, env in ((first, stage_env(0, 2, "0:0.4")), (second, stage_env(1, 2, "0.4:1"))):
            async with http.post(rt.url + "/init", json=init_body(SPLIT_MODEL, env=env)) as response:
                assert response.status == 200 and response.headers.get(STAGE_FRAMES_HEADER) == "1"
        frame = b"".join(pack_stage(json.dumps(run_body({"x": x.tolist(), "tag": "t"})).encode(), None,
                                    WELCOME_BLOB))
        async with http.post(first.url + "/run", data=frame, headers=headers) as response:
            assert response.status == 200 and response.content_type == STAGE_CONTENT_TYPE
            text, blob, _ = unpack_stage(await response.read())
        middle = json.loads(text)
        assert middle["dilu_stage"] == {"dtype": "float64", "shape": [3, 16]} and len(blob) == 3 * 16 * 8
        # the next stage gets it back as a frame too; as the last stage (no WELCOME_BLOB) it answers JSON
        value, _ = take_blob({**middle, "dilu_stage": {**middle["dilu_stage"], "data": Blob(blob)}})
        frame = b"".join(pack_stage(json.dumps(run_body(value)).encode(), blob))
        async with http.post(second.url + "/run", data=frame, headers=headers) as response:
            assert response.status == 200 and response.content_type == "application/json"
            result = await response.json()
        assert result["tag"] == "t" and result["layers"] == [[0, 3], [3, 7]] and len(result["y"]) == 3
        async with http.post(second.url + "/run", data=b"\0\0\0", headers=headers) as response:
            assert response.status == 400 and "Error reading request body" in (await response.json())["error"]
